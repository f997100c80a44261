"""Inline CSS and JavaScript of the HTML report (no network access, no CDN).

The head script runs first and records ``window.onerror``, unhandled rejections and
``console.error`` calls; the body script fills ``#console-errors`` with them, adds the step
filter, and sets ``#report-status`` (``data-state="ok"`` with counts, or ``"error"``) so a
headless browser's ``--dump-dom`` shows whether the page worked.
"""

CSS = """
:root { --keep: #2e7d32; --drop: #fde0dc; --pad: #f5f5f5; --ink: #1d2329; --dim: #6b7680; --line: #d9dee3; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--ink); margin: 0; background: #fafbfc; }
main { max-width: 1180px; margin: 0 auto; padding: 16px 20px 60px; }
h1 { font-size: 22px; margin: 8px 0 4px; } h2 { font-size: 17px; margin: 0 0 8px; } h3 { font-size: 14px; margin: 12px 0 6px; }
code, .mono, td, .topk, svg text { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
.dim { color: var(--dim); } .warn { color: #b26a00; } .bad { color: #c62828; font-weight: 600; } .ok { color: var(--keep); }
.facts { display: grid; grid-template-columns: max-content 1fr; gap: 2px 14px; margin: 8px 0 14px; }
.facts dt { font-weight: 600; } .facts dd { margin: 0; }
nav.steps { position: sticky; top: 0; background: #fafbfcee; padding: 6px 0; border-bottom: 1px solid var(--line); z-index: 2; }
nav.steps button { font: inherit; font-size: 12px; margin: 2px; padding: 2px 8px; border: 1px solid var(--line); border-radius: 10px; background: #fff; cursor: pointer; }
nav.steps button.on { background: var(--ink); color: #fff; }
section { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 12px 16px; margin: 14px 0; }
section.step.hidden { display: none; }
table { border-collapse: collapse; font-size: 12.5px; margin: 4px 0 8px; }
th, td { border-bottom: 1px solid var(--line); padding: 3px 8px; text-align: left; vertical-align: top; white-space: pre-wrap; }
th { font-family: system-ui, sans-serif; background: #f3f5f7; }
.figs { display: flex; flex-wrap: wrap; gap: 18px; align-items: flex-start; }
figure { margin: 0; } figcaption { font-size: 12px; max-width: 560px; margin-bottom: 4px; }
.tag { display: inline-block; font-size: 11px; padding: 0 6px; border-radius: 8px; margin-right: 4px; }
.tag.recorded { background: #e3f2fd; color: #0d47a1; } .tag.derived { background: #fff3e0; color: #e65100; }
svg { display: block; overflow: visible; }
svg text { font-size: 9px; fill: #37474f; } svg text.ch, svg text.cl { text-anchor: middle; } svg text.rl { text-anchor: end; }
svg text.cl { fill: #fff; font-size: 9px; }
svg rect.k { fill: var(--keep); } svg rect.d { fill: var(--drop); } svg rect.p { fill: var(--pad); }
svg rect.head { fill: #d32f2f; }
.legend span { display: inline-block; width: 10px; height: 10px; margin: 0 4px 0 12px; vertical-align: -1px; }
.topk { max-width: 640px; } .topk-row { display: grid; grid-template-columns: 60px 160px 1fr 60px 110px; white-space: nowrap; gap: 8px; align-items: center; font-size: 12.5px; }
.topk-track { background: #eef1f4; height: 12px; border-radius: 3px; } .topk-bar { display: block; height: 12px; background: #78909c; border-radius: 3px; }
.topk-row.chosen .topk-bar { background: var(--keep); } .topk-row.chosen .tok { font-weight: 700; color: var(--keep); }
.num { text-align: right; }
#report-status { position: fixed; right: 8px; bottom: 8px; font-size: 11px; color: var(--dim); }
#console-errors:empty { display: none; } #console-errors { color: #c62828; white-space: pre-wrap; }
"""

HEAD_JS = """
window.__infertraceErrors = [];
(function () {
  function note(msg) { window.__infertraceErrors.push(String(msg)); var el = document.getElementById('console-errors');
    if (el) { el.textContent = window.__infertraceErrors.join('\\n'); }
    var st = document.getElementById('report-status'); if (st && st.dataset.state === 'ok') { st.dataset.state = 'error'; } }
  window.addEventListener('error', function (e) { note('error: ' + (e.message || e.type)); });
  window.addEventListener('unhandledrejection', function (e) { note('unhandled rejection: ' + e.reason); });
  var orig = console.error;
  console.error = function () { note('console.error: ' + Array.prototype.join.call(arguments, ' ')); return orig.apply(console, arguments); };
})();
"""

BODY_JS = """
(function () {
  var status = document.getElementById('report-status');
  try {
    var sections = Array.prototype.slice.call(document.querySelectorAll('section.step'));
    var nav = document.querySelector('nav.steps');
    function show(which) {
      sections.forEach(function (s) { s.classList.toggle('hidden', which !== 'all' && s.dataset.step !== which); });
      Array.prototype.forEach.call(nav.querySelectorAll('button'), function (b) { b.classList.toggle('on', b.dataset.show === which); });
    }
    function button(label, which) {
      var b = document.createElement('button'); b.textContent = label; b.dataset.show = which;
      b.addEventListener('click', function () { show(which); }); nav.appendChild(b);
    }
    button('all steps', 'all');
    sections.forEach(function (s) { button('step ' + s.dataset.step, s.dataset.step); });
    show('all');
    var n = { steps: sections.length, heatmaps: document.querySelectorAll('svg.heatmap').length,
              cellmaps: document.querySelectorAll('svg.occupancy').length, bars: document.querySelectorAll('.topk-bar').length };
    var el = document.getElementById('console-errors');
    el.textContent = window.__infertraceErrors.join('\\n');
    status.dataset.state = window.__infertraceErrors.length ? 'error' : 'ok';
    status.dataset.steps = n.steps; status.dataset.heatmaps = n.heatmaps; status.dataset.cellmaps = n.cellmaps; status.dataset.bars = n.bars;
    status.textContent = (window.__infertraceErrors.length ? 'errors' : 'ok') + ': ' + n.steps + ' steps, ' + n.heatmaps +
      ' heatmaps, ' + n.cellmaps + ' cache maps, ' + n.bars + ' top-k bars';
  } catch (e) {
    window.__infertraceErrors.push('report script: ' + e);
    status.dataset.state = 'error'; status.textContent = 'error: ' + e;
    document.getElementById('console-errors').textContent = window.__infertraceErrors.join('\\n');
  }
})();
"""
