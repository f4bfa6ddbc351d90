// The tokenizer tests' corpus, written deterministically: the repository's own prose and code,
// and generated text in many scripts, with emoji, whitespace runs, digits, combining marks,
// special tokens inside text, and invalid UTF-8.
//
//   node corpus.js REPO_ROOT OUT_FILE
//
// OUT_FILE holds documents, each as a little-endian uint32 byte length, a flags byte (1: valid
// UTF-8 in NFC, so decode(encode(x)) must give x back), and the bytes.
'use strict';
const fs = require('fs');
const path = require('path');

function rng(seed) {  // mulberry32
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6D2B79F5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const [root, out] = process.argv.slice(2);
const docs = [];  // [Buffer, flags]
const add = (buf, clean) => docs.push([buf, clean ? 1 : 0]);
const isNfc = (s) => s === s.normalize('NFC');

// 1. the repository's prose and code, one document per file
function walk(dir) {
  for (const e of fs.readdirSync(dir, { withFileTypes: true }).sort((a, b) => a.name.localeCompare(b.name))) {
    const p = path.join(dir, e.name);
    if (e.isDirectory()) {
      if (e.name !== 'node_modules' && !e.name.startsWith('.')) walk(p);
    } else if (/\.(md|cpp|hpp|cu|py|cmake|sh|txt|json)$/.test(e.name) && fs.statSync(p).size < 400000) {
      const b = fs.readFileSync(p);
      add(b, isNfc(b.toString('utf8')) && Buffer.compare(Buffer.from(b.toString('utf8'), 'utf8'), b) === 0);
    }
  }
}
for (const d of ['README.md', 'docs', 'include', 'src', 'tests', 'examples', 'bench', 'scripts']) {
  const p = path.join(root, d);
  if (!fs.existsSync(p)) continue;
  if (fs.statSync(p).isDirectory()) walk(p);
  else add(fs.readFileSync(p), true);
}

// 2. generated text
const r = rng(20261125);
const pick = (a) => a[Math.floor(r() * a.length)];
const range = (lo, hi) => String.fromCodePoint(lo + Math.floor(r() * (hi - lo + 1)));
const scripts = [
  [0x61, 0x7A], [0x41, 0x5A], [0xC0, 0xFF], [0x100, 0x17F], [0x391, 0x3C9], [0x410, 0x44F], [0x5D0, 0x5EA],
  [0x627, 0x64A], [0x905, 0x939], [0xE01, 0xE2E], [0x4E00, 0x9FA5], [0x3041, 0x3096], [0x30A1, 0x30FA],
  [0xAC00, 0xD7A3], [0x10A0, 0x10FF], [0x1200, 0x135A], [0x13A0, 0x13F4],
];
const emoji = ['😀', '🤗', '👍🏽', '👨‍👩‍👧‍👦', '🇫🇷', '❤️', '🚀', '🧪', '✅', '🐍', '🦀', '1️⃣', '🏳️‍🌈'];
const spaces = [' ', '  ', '   ', '\t', '\n', '\n\n', '\r\n', ' \n ', '\u00A0', '\u3000', '\u2028', '\u2003', '\u200B', '\u0085', '        '];
const punct = ['.', ',', '!', '?', ';', ':', '...', '—', '–', '"', "'", '«', '»', '“', '”', '(', ')', '[', ']', '{', '}', '<', '>', '/', '\\', '#', '@', '&', '%', '$', '€', '£', '¥', '™', '©', '§'];
const words = ["I'm", "you're", "it's", "We'VE", "they'll", "don't", "SHE'D", "O'Neil", "rock'n'roll", 'the', 'tokenizer',
  'megatrain', 'café', 'naïve', 'Straße', 'İstanbul', 'ǅemal', 'ﬁnance', 'x²', '½', 'Ⅻ', '𝔘𝔫𝔦𝔠𝔬𝔡𝔢', 'e\u0301', 'a\u0308\u0323', 'n\u0303'];
const specials = ['<|endoftext|>', '<|im_start|>', '<|im_end|>', '<s>', '</s>', '<unk>', '<|begin_of_text|>', '<|eot_id|>',
  '<|start_header_id|>', '<think>', '<|endoftext', '<|im_start|><|im_end|>'];
const digits = () => {
  let s = '';
  const n = 1 + Math.floor(r() * 12);
  for (let i = 0; i < n; i++) s += r() < 0.85 ? String(Math.floor(r() * 10)) : pick(['٣', '०', '５', '١', '.', ',', '_']);
  return s;
};
let nfcOnly = false;  // every other generated document keeps to NFC text (decode(encode(x)) == x)
function word() {
  const k = r();
  if (k < 0.25) {
    let w = pick(words);
    while (nfcOnly && !isNfc(w)) w = pick(words);
    return w;
  }
  if (k < 0.35) return digits();
  if (k < 0.42) return pick(emoji);
  if (k < 0.47) return pick(specials);
  const [lo, hi] = pick(scripts);
  let s = '';
  const n = 1 + Math.floor(r() * 9);
  for (let i = 0; i < n; i++) s += range(lo, hi);
  if (r() < 0.1) s = s.toUpperCase();
  return s;
}
function text(n) {
  let s = '';
  for (let i = 0; i < n; i++) {
    s += word();
    const k = r();
    s += k < 0.6 ? ' ' : k < 0.8 ? pick(punct) + ' ' : k < 0.95 ? pick(spaces) : pick(punct);
  }
  return s;
}
for (let d = 0; d < 1500; d++) {
  nfcOnly = d % 2 === 0;
  const s = text(20 + Math.floor(r() * 400));
  add(Buffer.from(s, 'utf8'), isNfc(s));
}
// whitespace-only and edge documents
for (const s of ['', ' ', '\n', '   \n\n\t ', 'a', '<|endoftext|>', ' <|endoftext|> ', '<s></s>', "'s", "  's  'S", '\r\n\r\n', '0123456789012345']) {
  add(Buffer.from(s, 'utf8'), isNfc(s));
}
// 3. invalid UTF-8: stray continuation bytes, truncated sequences, surrogates, overlongs, > U+10FFFF
const bad = [[0x80], [0xC3], [0xE2, 0x82], [0xF0, 0x9F, 0x98], [0xED, 0xA0, 0x80], [0xC0, 0xAF], [0xE0, 0x80, 0xAF],
  [0xF4, 0x90, 0x80, 0x80], [0xF5], [0xFF], [0xFE, 0xFE], [0xC3, 0x28], [0xE2, 0x28, 0xA1]];
for (let d = 0; d < 200; d++) {
  const parts = [];
  for (let i = 0; i < 30; i++) {
    parts.push(Buffer.from(text(1 + Math.floor(r() * 5)), 'utf8'));
    if (r() < 0.5) parts.push(Buffer.from(pick(bad)));
  }
  add(Buffer.concat(parts), false);
}

const chunks = [];
for (const [b, f] of docs) {
  const h = Buffer.alloc(5);
  h.writeUInt32LE(b.length, 0);
  h[4] = f;
  chunks.push(h, b);
}
fs.writeFileSync(out, Buffer.concat(chunks));
const bytes = docs.reduce((a, [b]) => a + b.length, 0);
console.log(`corpus: ${docs.length} documents, ${(bytes / 1e6).toFixed(2)} MB -> ${out}`);
