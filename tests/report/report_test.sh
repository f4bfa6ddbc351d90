#!/usr/bin/env bash
# report.html end to end: a short run of megatrain-train, megatrain-report on its folder, and the
# page rendered in headless Chromium: every chart is an <svg> that lays out with lines of nonzero
# length, a screenshot is a PNG of nonzero size, and the file references nothing on a network.
#
#   report_test.sh MEGATRAIN_TRAIN MEGATRAIN_REPORT WORK_DIR
#
# Exit status: 0 pass, 1 fail, 77 skipped (no chromium: Debian's package `chromium`; or set
# MEGATRAIN_CHROMIUM to a Chromium or Chrome binary).
set -euo pipefail
TRAIN=$1 REPORT=$2 WORK=$3

CHROMIUM=${MEGATRAIN_CHROMIUM:-}
if [[ -z $CHROMIUM ]]; then
  for c in chromium chromium-browser google-chrome; do
    if command -v "$c" >/dev/null 2>&1; then CHROMIUM=$(command -v "$c"); break; fi
  done
fi
if [[ -z $CHROMIUM ]]; then
  echo "SKIP: no chromium (apt-get install chromium, or set MEGATRAIN_CHROMIUM)"
  exit 77
fi

fail() { echo "FAIL: $*" >&2; exit 1; }

rm -rf "$WORK"
mkdir -p "$WORK"
RUN=$WORK/run

# A short run with evaluations (the CPU backend: a second or two).
"$TRAIN" --hidden 32 --layers 1 --heads 2 --kv-heads 1 --intermediate 64 --batch 2 --seq 16 --steps 12 --eval-every 4 \
  --backend cpu --out "$RUN" > "$WORK/train.log" 2>&1 || { cat "$WORK/train.log"; fail "megatrain-train failed"; }
rm -f "$RUN/report.html"  # (megatrain-train's own, if it writes one: this test is of megatrain-report's)

# megatrain-report on the folder.
out=$("$REPORT" "$RUN") || fail "megatrain-report $RUN failed"
[[ $out == "$RUN/report.html" ]] || fail "megatrain-report printed '$out', not $RUN/report.html"
HTML=$RUN/report.html
[[ -s $HTML ]] || fail "no $HTML"

# Self-contained: no network reference, no script, no external file.
if grep -Eino 'https?://|<script|<link|<img|<iframe|@import|url\(' "$HTML" | head -5 | grep .; then
  fail "$HTML references something outside itself (above)"
fi

# The page as Chromium parses it: the charts and their data.
chrome() {
  timeout 120 "$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --no-first-run \
    --user-data-dir="$WORK/profile" "$@" 2> "$WORK/chromium.log"
}
chrome --dump-dom "file://$HTML" > "$WORK/dom.html" || { cat "$WORK/chromium.log"; fail "chromium --dump-dom failed"; }
for id in loss lr grad_norm tokens_per_s; do
  grep -q "<svg [^>]*data-chart=\"$id\"" "$WORK/dom.html" || fail "no chart '$id' in the DOM"
done
grep -q 'data-series="train loss" data-points="12"' "$WORK/dom.html" || fail "the loss chart does not hold the 12 steps"
grep -q 'data-series="val loss" data-points="3"' "$WORK/dom.html" || fail "the loss chart does not hold the 3 evaluations"
grep -Eq '<polyline class="line" points="[0-9.]+,[0-9.]+ [0-9.]+,[0-9.]+' "$WORK/dom.html" || fail "no polyline with points"
grep -q '<th>steps</th><td>12 (steps 1 to 12)</td>' "$WORK/dom.html" || fail "the summary does not say 12 steps"
grep -q '<th>eval-every</th><td>4</td>' "$WORK/dom.html" || fail "the options table lacks eval-every"
grep -q '<th>hidden_size</th><td>32</td>' "$WORK/dom.html" || fail "the model table lacks hidden_size"

# Laid out: a copy of the page with a probe that measures each chart and line as rendered
# (the report itself has no script).
PROBE=$RUN/probe.html
probe_js='addEventListener("load", () => {
  const r = [];
  for (const s of document.querySelectorAll("svg[data-chart]")) {
    const b = s.getBoundingClientRect();
    let len = 0;
    for (const p of s.querySelectorAll("polyline")) len += p.getTotalLength();
    r.push(s.dataset.chart + ":" + Math.round(b.width) + "x" + Math.round(b.height) + ":" + Math.round(len));
  }
  const pre = document.createElement("pre");
  pre.id = "probe";
  pre.textContent = r.join(" ");
  document.body.append(pre);
});'
{ sed -e 's|</body>||' -e 's|</html>||' "$HTML"; printf '<script>%s</script>\n</body>\n</html>\n' "$probe_js"; } > "$PROBE"
chrome --dump-dom --virtual-time-budget=5000 --window-size=1280,1000 "file://$PROBE" > "$WORK/probe_dom.html" ||
  { cat "$WORK/chromium.log"; fail "chromium --dump-dom of the probe failed"; }
probe=$(sed -n 's|.*<pre id="probe">\([^<]*\)</pre>.*|\1|p' "$WORK/probe_dom.html")
echo "rendered charts (id:width x height:polyline length in px): $probe"
[[ -n $probe ]] || fail "the probe did not run"
for id in loss lr grad_norm tokens_per_s; do
  [[ " $probe " =~ \ $id:([0-9]+)x([0-9]+):([0-9]+)\  ]] || fail "chart '$id' was not rendered ($probe)"
  (( BASH_REMATCH[1] >= 300 && BASH_REMATCH[2] >= 100 && BASH_REMATCH[3] > 100 )) ||
    fail "chart '$id' renders at ${BASH_REMATCH[1]}x${BASH_REMATCH[2]} px with ${BASH_REMATCH[3]} px of lines"
done

# A screenshot: a PNG of nonzero size.
chrome --screenshot="$WORK/report.png" --window-size=1280,2400 --hide-scrollbars "file://$HTML" > /dev/null ||
  { cat "$WORK/chromium.log"; fail "chromium --screenshot failed"; }
[[ -s $WORK/report.png ]] || fail "no screenshot"
[[ $(head -c 8 "$WORK/report.png" | od -An -tx1 | tr -d ' \n') == 89504e470d0a1a0a ]] || fail "the screenshot is not a PNG"
echo "screenshot: $WORK/report.png ($(stat -c %s "$WORK/report.png") bytes)"

# --output, and the errors a user sees: the folder or file named, exit 1.
"$REPORT" "$RUN" --output "$WORK/elsewhere.html" --title "Run <12>" > /dev/null || fail "--output failed"
grep -q '<h1>Run &lt;12&gt;</h1>' "$WORK/elsewhere.html" || fail "--output lacks the escaped --title"
expect_error() {  # expect_error PATTERN ARGS...
  local pattern=$1 rc=0
  shift
  "$REPORT" "$@" > "$WORK/err.log" 2>&1 || rc=$?
  [[ $rc == 1 ]] || { cat "$WORK/err.log"; fail "megatrain-report $* exited $rc, not 1"; }
  grep -q -- "$pattern" "$WORK/err.log" || { cat "$WORK/err.log"; fail "megatrain-report $*: no '$pattern' in the error"; }
}
expect_error "run folder '$WORK/absent' does not exist" "$WORK/absent"
mkdir -p "$WORK/empty"
expect_error "'$WORK/empty' holds no metrics.jsonl" "$WORK/empty"
cp "$RUN/metrics.jsonl" "$WORK/bad.jsonl"
{ head -n 3 "$WORK/bad.jsonl"; echo '{"step": 4, "loss": '; tail -n +4 "$WORK/bad.jsonl"; } > "$RUN/metrics.jsonl"
expect_error "metrics.jsonl' line 4 is not a JSON object of metrics" "$RUN"
expect_error "the folder '$WORK/nowhere' does not exist" "$WORK" --output "$WORK/nowhere/r.html"
expect_error "RUN_DIR is required" 
echo "PASS"
