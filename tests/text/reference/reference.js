// Hugging Face tokenizers' ids and decoded text for every document of a corpus (corpus.js).
//
//   node reference.js TOKENIZER_JSON CORPUS OUT [add_special_tokens: 0|1]
//
// OUT holds, per document: a little-endian uint32 count and the ids (uint32), then a uint32 byte
// length and the UTF-8 of decode(ids, skip_special_tokens = false). The documents' bytes are
// decoded as UTF-8 by Node (invalid bytes become U+FFFD, as in Rust's from_utf8_lossy).
// Prints the reference's encoding speed (MB/s of input bytes, encodeBatch, all threads).
'use strict';
const fs = require('fs');
const { Tokenizer } = require('@anush008/tokenizers');

(async () => {
  const [tokFile, corpusFile, outFile, special] = process.argv.slice(2);
  const addSpecial = special === '1';
  const tok = Tokenizer.fromFile(tokFile);
  const buf = fs.readFileSync(corpusFile);
  const texts = [];
  let bytes = 0;
  for (let at = 0; at < buf.length;) {
    const n = buf.readUInt32LE(at);
    texts.push(buf.subarray(at + 5, at + 5 + n).toString('utf8'));
    bytes += n;
    at += 5 + n;
  }
  const t0 = process.hrtime.bigint();
  const encs = await tok.encodeBatch(texts, { addSpecialTokens: addSpecial });
  const secs = Number(process.hrtime.bigint() - t0) / 1e9;
  const ids = encs.map((e) => e.getIds());
  const decoded = await tok.decodeBatch(ids, false);
  const out = [];
  for (let i = 0; i < ids.length; i++) {
    const h = Buffer.alloc(4 + 4 * ids[i].length);
    h.writeUInt32LE(ids[i].length, 0);
    ids[i].forEach((v, k) => h.writeUInt32LE(v, 4 + 4 * k));
    const d = Buffer.from(decoded[i], 'utf8');
    const l = Buffer.alloc(4);
    l.writeUInt32LE(d.length, 0);
    out.push(h, l, d);
  }
  fs.writeFileSync(outFile, Buffer.concat(out));
  console.log(JSON.stringify({ tokenizer: tokFile, documents: texts.length, mb: bytes / 1e6, seconds: secs, mb_per_s: bytes / 1e6 / secs }));
})().catch((e) => { console.error(e); process.exit(1); });
