// fastweights lab: the page only draws. Every number comes from the server (fastweights.ops);
// this file reads the controls, posts them to /api/<panel>, and draws the answer as SVG.
"use strict";

const LAB = { config: null, seq: {}, busy: {}, pending: {}, last: {}, timings: {} };
window.LAB = LAB;

const $ = (sel, root = document) => root.querySelector(sel);
const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));
const SVG_NS = "http://www.w3.org/2000/svg";
const BLUE = "#1f77b4", ORANGE = "#ff7f0e", GREEN = "#2ca02c", RED = "#d62728", GRAY = "#888", PURPLE = "#9467bd";
const PAIR_COLORS = [BLUE, ORANGE, GREEN, RED, PURPLE, "#8c564b", "#e377c2", "#17becf"];

// ---------------------------------------------------------------------------
// formatting and SVG helpers

function num(x, digits = 4) {
  if (x === null || x === undefined) return "–";
  if (Math.abs(x) < 1e-12) return "0";
  return String(Number(x.toPrecision(digits)));
}
function vec(v, digits = 4) { return "(" + v.map((x) => num(x, digits)).join(", ") + ")"; }
function mat(m, digits = 4) { return "[" + m.map((r) => "[" + r.map((x) => num(x, digits)).join(", ") + "]").join(", ") + "]"; }
function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? String(n) : n.toFixed(n < 10 ? 2 : 1)) + " " + units[i];
}

function el(tag, attrs = {}, parent = null, text = null) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== null) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}
function clear(svg) { while (svg.firstChild) svg.removeChild(svg.firstChild); return svg; }
function size(svg) { return [Number(svg.getAttribute("width")), Number(svg.getAttribute("height"))]; }

function scale(lo, hi, a, b, log = false) {
  const f = log ? Math.log10 : (x) => x;
  const l = f(lo), h = f(hi);
  return (x) => a + ((f(x) - l) / (h - l || 1)) * (b - a);
}

function ticks(lo, hi, n = 5) {
  const step = Math.pow(10, Math.floor(Math.log10((hi - lo) / n || 1)));
  const err = ((hi - lo) / n) / step;
  const s = step * (err >= 7.5 ? 10 : err >= 3.5 ? 5 : err >= 1.5 ? 2 : 1);
  const out = [];
  for (let t = Math.ceil(lo / s) * s; t <= hi + 1e-9; t += s) out.push(Number(t.toPrecision(10)));
  return out;
}

function arrow(g, x0, y0, x1, y1, color, opts = {}) {
  const line = el("line", { x1: x0, y1: y0, x2: x1, y2: y1, stroke: color, "stroke-width": opts.width || 2 }, g);
  if (opts.dash) line.setAttribute("stroke-dasharray", opts.dash);
  const len = Math.hypot(x1 - x0, y1 - y0);
  if (len > 3) {
    const ux = (x1 - x0) / len, uy = (y1 - y0) / len, h = Math.min(9, len / 2);
    const pts = [[x1, y1], [x1 - h * ux + 0.5 * h * uy, y1 - h * uy - 0.5 * h * ux], [x1 - h * ux - 0.5 * h * uy, y1 - h * uy + 0.5 * h * ux]];
    el("polygon", { points: pts.map((p) => p.join(",")).join(" "), fill: color, opacity: opts.dash ? 0.6 : 1 }, g);
  }
  if (opts.label) el("text", { x: x1 + 4, y: y1 - 4, fill: color }, g, opts.label);
  return line;
}

// An x-y frame with axes; returns {g, x, y, y2} scales into the plotting area.
function frame(svg, xr, yr, opts = {}) {
  clear(svg);
  const [w, h] = size(svg);
  const m = { l: opts.left || 44, r: opts.right || (opts.y2 ? 48 : 12), t: 10, b: 32 };
  const x = scale(xr[0], xr[1], m.l, w - m.r, opts.xlog);
  const y = scale(yr[0], yr[1], h - m.b, m.t, opts.ylog);
  const g = el("g", {}, svg);
  el("line", { x1: m.l, y1: h - m.b, x2: w - m.r, y2: h - m.b, stroke: "#333" }, g);
  el("line", { x1: m.l, y1: m.t, x2: m.l, y2: h - m.b, stroke: "#333" }, g);
  const xt = opts.xticks || (opts.xlog ? logTicks(xr) : ticks(xr[0], xr[1]));
  for (const t of xt) {
    el("line", { x1: x(t), y1: h - m.b, x2: x(t), y2: h - m.b + 4, stroke: "#333" }, g);
    el("text", { x: x(t), y: h - m.b + 14, "text-anchor": "middle" }, g, opts.xfmt ? opts.xfmt(t) : num(t, 3));
  }
  const yt = opts.yticks || (opts.ylog ? logTicks(yr) : ticks(yr[0], yr[1]));
  for (const t of yt) {
    el("line", { x1: m.l - 4, y1: y(t), x2: w - m.r, y2: y(t), stroke: "#eee" }, g);
    el("text", { x: m.l - 6, y: y(t) + 3, "text-anchor": "end" }, g, opts.yfmt ? opts.yfmt(t) : num(t, 3));
  }
  if (opts.xlabel) el("text", { x: (m.l + w - m.r) / 2, y: h - 4, "text-anchor": "middle" }, g, opts.xlabel);
  let y2 = null;
  if (opts.y2) {
    y2 = scale(opts.y2[0], opts.y2[1], h - m.b, m.t);
    el("line", { x1: w - m.r, y1: m.t, x2: w - m.r, y2: h - m.b, stroke: "#333" }, g);
    for (const t of ticks(opts.y2[0], opts.y2[1])) el("text", { x: w - m.r + 6, y: y2(t) + 3, fill: ORANGE }, g, num(t, 3));
  }
  return { g, x, y, y2, m, w, h };
}
function logTicks(r) {
  const out = [];
  for (let p = Math.ceil(Math.log10(r[0])); p <= Math.floor(Math.log10(r[1])); p++) out.push(Math.pow(10, p));
  return out;
}
function polyline(g, pts, color, opts = {}) {
  const line = el("polyline", { points: pts.map((p) => p.join(",")).join(" "), fill: "none", stroke: color, "stroke-width": opts.width || 2 }, g);
  if (opts.dash) line.setAttribute("stroke-dasharray", opts.dash);
  return line;
}

function heatColor(v, vmax) {
  const t = Math.max(-1, Math.min(1, v / (vmax || 1)));
  const a = Math.round(255 * (1 - Math.abs(t)));
  return t >= 0 ? `rgb(255,${a},${a})` : `rgb(${a},${a},255)`;
}

// ---------------------------------------------------------------------------
// controls: ranges and choices come from /api/config (the server's field checks)

function setupControls(name) {
  const section = document.getElementById(name);
  const fields = LAB.config[name].fields;
  $(".passage", section).textContent = LAB.config[name].passage;
  for (const node of $$("[name]", section)) {
    const f = fields[node.name];
    if (!f) continue;
    if (node.tagName === "SELECT") {
      for (const c of f.choices) node.appendChild(Object.assign(document.createElement("option"), { value: c, textContent: c }));
    } else if (node.type === "range") {
      if (node.dataset.log) { node.min = Math.log10(f.lo); node.max = Math.log10(f.hi); }
      else { node.min = f.lo; node.max = f.hi; if (f.kind === "int") node.step = 1; }
    } else if (node.type === "number") {
      node.min = f.lo; node.max = f.hi;
    }
  }
  setValues(name, defaults(name));
}

function defaults(name) {
  const out = {};
  for (const [k, f] of Object.entries(LAB.config[name].fields)) out[k] = f.default;
  return out;
}

function setValues(name, values) {
  const section = document.getElementById(name);
  for (const [k, v] of Object.entries(values)) {
    for (const node of $$(`[name="${k}"]`, section)) {
      if (node.type === "range" && node.dataset.log) node.value = Math.log10(v);
      else node.value = v;
    }
  }
  syncOutputs(section);
}

function controlValue(section, key) {
  const nodes = $$(`[name="${key}"]`, section);
  const numBox = nodes.find((n) => n.type === "number");
  const node = numBox || nodes[0];
  if (!node) return undefined;
  if (node.tagName === "SELECT" || node.type === "text" || node.tagName === "TEXTAREA") return node.value;
  if (node.type === "range" && node.dataset.log) return Number(Math.pow(10, Number(node.value)).toPrecision(4));
  return node.value.trim() === "" ? null : Number(node.value);
}

function syncOutputs(section) {
  for (const out of $$("output[data-for]", section)) {
    const key = out.dataset.for;
    out.textContent = num(controlValue(section, key), 3);
  }
  for (const label of $$("[data-show]", section)) {
    const [key, vals] = label.dataset.show.split("=");
    label.style.display = vals.split(",").includes(controlValue(section, key)) ? "" : "none";
  }
}

function paramsOf(name, keys) {
  const section = document.getElementById(name);
  const out = {};
  for (const k of keys) out[k] = controlValue(section, k);
  return out;
}

// ---------------------------------------------------------------------------
// requests: one in flight per panel; the newest settings win

async function update(name) {
  if (LAB.busy[name]) { LAB.pending[name] = true; return; }
  LAB.busy[name] = true;
  const section = document.getElementById(name);
  const seq = (LAB.seq[name] || 0) + 1;
  LAB.seq[name] = seq;
  const started = LAB.timings[name + "_input"] || performance.now();
  LAB.timings[name + "_input"] = null;
  let res = null, data = null, problem = null;
  try {
    res = await fetch("/api/" + name, { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(PANELS[name].params()) });
    data = await res.json();
    if (!res.ok) problem = data.error || `the server answered ${res.status}`;
  } catch (e) {
    problem = "the lab server did not answer: " + e;
  }
  $(".error", section).textContent = problem ? problem : "";
  section.dataset.status = problem ? String(res ? res.status : "offline") : "200";
  if (!problem) {
    LAB.last[name] = data;
    PANELS[name].draw(data);
  }
  await new Promise((r) => requestAnimationFrame(() => setTimeout(r, 0)));
  section.dataset.updateMs = (performance.now() - started).toFixed(1);
  section.dataset.computeMs = data && data.compute_ms !== undefined ? data.compute_ms : "";
  section.dataset.seq = String(seq);
  LAB.busy[name] = false;
  if (LAB.pending[name]) { LAB.pending[name] = false; update(name); }
}

function wire(name) {
  const section = document.getElementById(name);
  for (const node of $$("[name]", section)) {
    if (node.name === "step") continue;
    node.addEventListener(node.tagName === "SELECT" ? "change" : "input", () => {
      if (!LAB.timings[name + "_input"]) LAB.timings[name + "_input"] = performance.now();
      // keep a slider and its number box together
      for (const twin of $$(`[name="${node.name}"]`, section)) if (twin !== node) twin.value = node.value;
      syncOutputs(section);
      update(name);
    });
  }
  $(".reset", section).addEventListener("click", () => {
    setValues(name, Object.assign(defaults(name), LAB.config[name].example));
    if (PANELS[name].reset) PANELS[name].reset();
    update(name);
  });
}

// ---------------------------------------------------------------------------
// 1. interference

function drawInterference(r) {
  $("#n-value").textContent = r.n;
  $("#recall-value").textContent = num(r.recall, 3);
  $("#error-value").textContent = num(r.error, 3);
  $("#trials-value").textContent = r.trials;
  $("#cosine-value").textContent = r.mean_key_cosine === null ? "" : `keys: mean pairwise cosine ${num(r.mean_key_cosine, 2)}, largest |cosine| ${num(r.max_key_cosine, 2)}`;

  const xs = r.curve.map((c) => c.n);
  const emax = Math.max(1e-9, ...r.curve.map((c) => c.error)) * 1.1;
  const F = frame($("#curve"), [0, Math.max(...xs)], [0, 1.05], { y2: [0, emax], xlabel: "stored pairs N", yticks: [0, 0.25, 0.5, 0.75, 1] });
  if (r.d <= Math.max(...xs)) {
    el("line", { x1: F.x(r.d), y1: F.m.t, x2: F.x(r.d), y2: F.h - F.m.b, stroke: GRAY, "stroke-dasharray": "4 3" }, F.g);
    el("text", { x: F.x(r.d) + 3, y: F.m.t + 10, fill: GRAY }, F.g, "N = d");
  }
  polyline(F.g, r.curve.map((c) => [F.x(c.n), F.y(c.recall)]), BLUE);
  polyline(F.g, r.curve.map((c) => [F.x(c.n), F.y2(c.error)]), ORANGE);
  for (const c of r.curve) el("circle", { cx: F.x(c.n), cy: F.y(c.recall), r: 2.5, fill: BLUE }, F.g);
  el("line", { x1: F.x(r.n), y1: F.m.t, x2: F.x(r.n), y2: F.h - F.m.b, stroke: "#000", "stroke-width": 1 }, F.g);
  el("circle", { cx: F.x(r.n), cy: F.y(r.recall), r: 5, fill: "none", stroke: "#000", "stroke-width": 2 }, F.g);
  const right = F.x(r.n) > (F.m.l + F.w - F.m.r) / 2 + 60;  // keep the label inside the frame
  el("text", { x: F.x(r.n) + (right ? -6 : 6), y: F.y(r.recall) - 8, "text-anchor": right ? "end" : "start" }, F.g, `N=${r.n}: ${num(r.recall, 3)}`);

  const pe = Math.max(1e-9, ...r.pairs.map((p) => p.error)) * 1.1;
  const P = frame($("#pairs"), [0.5, r.n + 0.5], [0, pe], { xlabel: "pair (draw order)", xticks: ticks(1, r.n).filter((t) => Number.isInteger(t)) });
  const bw = Math.max(1, (P.x(1.5) - P.x(0.5)) * 0.8);
  for (const p of r.pairs) {
    const rect = el("rect", { x: P.x(p.pair) - bw / 2, y: P.y(p.error), width: bw, height: Math.max(0, P.y(0) - P.y(p.error)), fill: p.recalled ? GREEN : RED }, P.g);
    el("title", {}, rect, `pair ${p.pair}, written #${p.written}: |o − v| = ${num(p.error)}`);
  }

  $("#heat-title").textContent = r.heat.title;
  const H = clear($("#heat"));
  const [w, h] = size(H);
  const M = r.heat.matrix, rows = M.length, cols = M[0].length;
  const vmax = Math.max(1e-12, ...M.flat().map(Math.abs));
  const cw = (w - 20) / cols, ch = (h - 20) / rows;
  const g = el("g", { transform: "translate(10,10)" }, H);
  M.forEach((row, i) => row.forEach((v, j) => {
    el("rect", { x: j * cw, y: i * ch, width: cw + 0.3, height: ch + 0.3, fill: heatColor(v, vmax) }, g);
    if (rows * cols <= 16) el("text", { x: (j + 0.5) * cw, y: (i + 0.5) * ch + 4, "text-anchor": "middle", "font-size": 14 }, g, num(v));
  }));

  const wk = r.worked;
  fillWorked($("#worked-002"), wk.linear_attention);
  fillWorked($("#worked-001"), wk.delta_rule);
  const o = wk.overwrite;
  $("#overwrite-W").textContent = o.W ? mat(o.W) : "(softmax keeps the three rows; no matrix)";
  $("#overwrite-k1").textContent = vec(o.read_k1);
  $("#overwrite-k2").textContent = vec(o.read_k2);
  $("#overwrite-rule").textContent = `(rule: ${r.rule})`;
}

function fillWorked(table, rows) {
  table.innerHTML = "<tr><th>where</th><th>example</th><th>ops compute</th><th>docs say</th><th></th></tr>";
  for (const e of rows) {
    const tr = document.createElement("tr");
    const show = (x) => (x === null ? "–" : Array.isArray(x[0]) ? mat(x) : Array.isArray(x) ? vec(x) : num(x));
    for (const [text, cls] of [[e.where, ""], [e.name, ""], [show(e.computed), ""], [e.expected === null ? "(must differ)" : show(e.expected), ""], [e.ok ? "✓" : "✗", e.ok ? "ok" : "bad"]]) {
      const td = document.createElement("td");
      td.textContent = text;
      if (cls) td.className = cls;
      tr.appendChild(td);
    }
    table.appendChild(tr);
  }
}

// ---------------------------------------------------------------------------
// 2. 2-D geometry

function parseWrites(text) {
  const keys = [], values = [];
  for (const line of text.split("\n")) {
    if (!line.trim()) continue;
    const parts = line.split(/→|->/);
    const nums = (s) => (s || "").trim().split(/[\s,;()]+/).filter((x) => x !== "").map(Number);
    keys.push(nums(parts[0]));
    values.push(nums(parts[1]));
  }
  return { keys, values };
}
function writesText(keys, values) { return keys.map((k, i) => `${k.join(" ")} → ${values[i].join(" ")}`).join("\n"); }

function planeFrame(svg, extent) {
  clear(svg);
  const [w, h] = size(svg);
  const s = scale(-extent, extent, 14, w - 14);
  const sy = scale(-extent, extent, h - 14, 14);
  const g = el("g", {}, svg);
  for (const t of ticks(-extent, extent, 6)) {
    el("line", { x1: s(t), y1: sy(-extent), x2: s(t), y2: sy(extent), stroke: t === 0 ? "#999" : "#f0f0f0" }, g);
    el("line", { x1: s(-extent), y1: sy(t), x2: s(extent), y2: sy(t), stroke: t === 0 ? "#999" : "#f0f0f0" }, g);
    if (t !== 0) el("text", { x: s(t), y: sy(0) + 11, "text-anchor": "middle", fill: "#aaa" }, g, num(t, 2));
  }
  return { g, x: s, y: sy };
}

function drawGeometry(r) {
  const section = $("#geometry");
  const stepBox = $('[name="step"]', section);
  stepBox.max = r.frames.length - 1;
  if (Number(stepBox.value) > r.frames.length - 1) stepBox.value = r.frames.length - 1;
  drawGeometryStep();
}

function drawGeometryStep() {
  const r = LAB.last.geometry;
  if (!r) return;
  const section = $("#geometry");
  const t = Number($('[name="step"]', section).value);
  $('output[data-for="step"]', section).textContent = `${t} / ${r.frames.length - 1}`;
  const frames = r.frames.slice(1);
  const cur = r.frames[t];
  for (const rule of ["sum", "delta"]) {
    // each plane fits what it shows at this step (the tick labels give its scale)
    const shown = frames.slice(0, t).map((f) => f.value).concat(cur.reads[rule]);
    if (rule === "delta" && t > 0) shown.push(cur.delta_parts.old_read);
    const extent = Math.max(1.5, ...shown.flat().map(Math.abs)) * 1.15;
    const P = planeFrame($("#plane-" + rule), extent);
    frames.slice(0, t).forEach((f, i) => {
      const c = PAIR_COLORS[i % PAIR_COLORS.length];
      // keys live in key space: drawn as directions, at a fixed length so that they stay visible
      const kn = Math.hypot(f.key[0], f.key[1]) || 1, kl = 0.3 * extent / kn;
      arrow(P.g, P.x(0), P.y(0), P.x(kl * f.key[0]), P.y(kl * f.key[1]), i === t - 1 ? "#000" : GRAY, { width: 1, label: `k${i + 1}` });
      arrow(P.g, P.x(0), P.y(0), P.x(f.value[0]), P.y(f.value[1]), c, { dash: "5 3", width: 1.5 });
      const rd = cur.reads[rule][i];
      arrow(P.g, P.x(0), P.y(0), P.x(rd[0]), P.y(rd[1]), c, { label: `Wk${i + 1}` });
    });
    if (rule === "delta" && t > 0) {
      const parts = cur.delta_parts, o = parts.old_read;
      const mid = [o[0] + parts.erase[0], o[1] + parts.erase[1]];
      const end = [mid[0] + parts.write[0], mid[1] + parts.write[1]];
      el("circle", { cx: P.x(o[0]), cy: P.y(o[1]), r: 3, fill: "#000" }, P.g);
      arrow(P.g, P.x(o[0]), P.y(o[1]), P.x(mid[0]), P.y(mid[1]), RED, { width: 1.5, dash: "2 2", label: "erase" });
      arrow(P.g, P.x(mid[0]), P.y(mid[1]), P.x(end[0]), P.y(end[1]), GREEN, { width: 1.5, dash: "2 2", label: "write" });
    }
  }
  const H = planeFrame($("#householder"), Math.max(1.5, ...r.frames.slice(1).map((f) => Math.max(...f.householder.probe.map(Math.abs)))) * 1.2);
  if (t > 0) {
    const hh = cur.householder, k = cur.key;
    const kn = Math.hypot(k[0], k[1]) || 1;
    const big = 100;
    el("line", { x1: H.x(-big * k[1] / kn), y1: H.y(big * k[0] / kn), x2: H.x(big * k[1] / kn), y2: H.y(-big * k[0] / kn), stroke: PURPLE, "stroke-dasharray": "6 4" }, H.g);
    polyline(H.g, r.circle.map((p) => [H.x(p[0]), H.y(p[1])]), "#ccc", { width: 1 });
    polyline(H.g, hh.circle_image.map((p) => [H.x(p[0]), H.y(p[1])]), PURPLE, { width: 2 });
    arrow(H.g, H.x(0), H.y(0), H.x(k[0] / kn), H.y(k[1] / kn), GRAY, { label: "k/|k|" });
    arrow(H.g, H.x(0), H.y(0), H.x(hh.probe[0]), H.y(hh.probe[1]), BLUE, { dash: "5 3", label: "x" });
    arrow(H.g, H.x(0), H.y(0), H.x(hh.probe_image[0]), H.y(hh.probe_image[1]), BLUE, { label: "(I − βkkᵀ)x" });
    el("line", { x1: H.x(hh.probe[0]), y1: H.y(hh.probe[1]), x2: H.x(hh.probe_image[0]), y2: H.y(hh.probe_image[1]), stroke: BLUE, "stroke-dasharray": "1 3" }, H.g);
    $("#geometry-readout").textContent =
      `write ${t}: k = ${vec(cur.key)} → v = ${vec(cur.value)}, β = ${num(r.beta)}. ` +
      `Sum rule W = ${mat(cur.W.sum)}; delta rule W = ${mat(cur.W.delta)}. ` +
      `Before the write k read ${vec(cur.delta_parts.old_read)}; the delta rule erases ${vec(cur.delta_parts.erase)} and writes ${vec(cur.delta_parts.write)}. ` +
      `I − βkkᵀ = ${mat(hh.matrix)} maps x = ${vec(hh.probe)} to ${vec(hh.probe_image)}` + (Math.abs(hh.key_norm - 1) > 1e-9 ? ` (|k| = ${num(hh.key_norm)}: not a projection unless |k| = 1)` : "") + ".";
  } else {
    $("#geometry-readout").textContent = "step 0: both memories are empty (W = 0). Step through the writes.";
  }
}

// ---------------------------------------------------------------------------
// 3. spotlight vs floodlight

function drawSpotlight(r) {
  const box = $("#spot-bars");
  box.innerHTML = "";
  for (const m of r.methods) {
    const fig = document.createElement("figure");
    const cap = document.createElement("figcaption");
    cap.textContent = `${m.name}: target's share ${num(m.target_share, 3)}, effective tokens ${num(m.effective_tokens, 3)}` + (m.feature_dim ? ` (φ has ${m.feature_dim} features)` : "") + (m.note ? `. Note: ${m.note}` : "");
    fig.appendChild(cap);
    const svg = el("svg", { width: 360, height: 130 }, fig);
    svg.dataset.kind = m.kind;
    const lo = Math.min(0, ...m.weights), hi = Math.max(1e-12, ...m.weights);
    const F = frame(svg, [-0.5, r.t - 0.5], [lo, hi * 1.05], { xlabel: "token", xticks: ticks(0, r.t - 1).filter((t) => Number.isInteger(t)) });
    const bw = Math.max(1, (F.x(1) - F.x(0)) * 0.8);
    m.weights.forEach((w, i) => {
      const rect = el("rect", { x: F.x(i) - bw / 2, y: F.y(Math.max(w, 0)), width: bw, height: Math.abs(F.y(w) - F.y(0)), fill: i === r.target ? RED : BLUE }, F.g);
      el("title", {}, rect, `token ${i}: weight ${num(w)}`);
    });
    box.appendChild(fig);
  }
}

// ---------------------------------------------------------------------------
// 4. memory calculator

function drawMemory(r) {
  const c = r.calculator, cur = r.current;
  const t = $("#memory-table");
  const kinds = [["softmax", "softmax (KV cache)"], ["fixed_state", "fixed state"], ["hybrid", `hybrid (${c.model.softmax_layers} softmax layers)`]];
  t.innerHTML = `<tr><th>memory</th><th>per session at ${cur.context} tokens</th><th>sessions that fit in ${num(c.budget_gib)} GiB</th><th>${r.sessions} session(s) need</th><th>fit?</th></tr>`;
  for (const [k, label] of kinds) {
    const tr = document.createElement("tr");
    tr.dataset.kind = k;
    for (const text of [label, bytes(cur[k + "_bytes"]), String(cur[k + "_sessions"]), bytes(r.total_bytes[k]), r.fits[k] ? "yes" : "no"]) {
      const td = document.createElement("td"); td.textContent = text; tr.appendChild(td);
    }
    t.appendChild(tr);
  }
  $("#memory-readout").textContent = `A layer's KV cache outgrows its fixed state after ${num(c.crossover_context, 4)} tokens ` +
    `(d_k = ${c.model.head_dim_k}, d_v = ${c.model.head_dim_v}, KV ${c.model.kv_dtype}, state ${c.model.state_dtype}).`;

  const rows = c.rows.slice();
  if (!rows.some((x) => x.context === cur.context)) rows.push(cur);
  rows.sort((a, b) => a.context - b.context);
  const vals = rows.flatMap((x) => [x.softmax_bytes, x.fixed_state_bytes, x.hybrid_bytes]).concat([r.budget_bytes]);
  const lo = Math.min(...vals) / 2, hi = Math.max(...vals) * 2;
  const xr = [rows[0].context / 1.6, rows[rows.length - 1].context * 1.6];
  // y ticks at powers of 1024 (1 KiB, 1 MiB, ...), and at ×32 steps between them when the range is short
  let yt = [];
  for (let p = 0; Math.pow(2, p) <= hi; p += 5) if (Math.pow(2, p) >= lo) yt.push(Math.pow(2, p));
  if (yt.length > 7) yt = yt.filter((v) => Math.round(Math.log2(v)) % 10 === 0);
  const F = frame($("#memory-chart"), xr, [lo, hi], { xlog: true, ylog: true, left: 70, right: 230, yticks: yt, xlabel: "context length (tokens)", yfmt: bytes,
    xticks: rows.filter((x, i) => i % 2 === 0).map((x) => x.context), xfmt: (x) => (x >= 1048576 ? x / 1048576 + "M" : x >= 1024 ? x / 1024 + "K" : String(x)) });
  const bw = 10;
  for (const x of rows) {
    const isCur = x.context === cur.context;
    el("rect", { x: F.x(x.context) - bw / 2, y: F.y(x.softmax_bytes), width: bw, height: F.y(lo) - F.y(x.softmax_bytes), fill: isCur ? RED : "#f4a3a3" }, F.g);
  }
  polyline(F.g, rows.map((x) => [F.x(x.context), F.y(x.fixed_state_bytes)]), BLUE, { width: 3 });
  if (c.model.softmax_layers > 0) polyline(F.g, rows.map((x) => [F.x(x.context), F.y(x.hybrid_bytes)]), PURPLE, { width: 2 });
  el("line", { x1: F.x(xr[0]), y1: F.y(r.budget_bytes), x2: F.x(xr[1]), y2: F.y(r.budget_bytes), stroke: GRAY, "stroke-dasharray": "6 4" }, F.g);
  const lx = F.w - F.m.r + 12;
  [["softmax: KV cache (bars;", RED], ["  current context in red)", null], ["fixed state (flat line)", BLUE], [`hybrid: ${c.model.softmax_layers} softmax layers`, PURPLE], [`GPU memory ${num(c.budget_gib)} GiB`, GRAY]].forEach(([text, color], i) => {
    if (color) el("rect", { x: lx, y: 14 + i * 16, width: 10, height: 8, fill: color }, F.g);
    el("text", { x: lx + 14, y: 22 + i * 16, "font-size": 11 }, F.g, text);
  });
}

// ---------------------------------------------------------------------------
// 5. state tracking

function drawTracking(r) {
  const T = r.bits.length;
  const wrong = r.right.filter((x) => !x).length;
  $("#tracking-readout").textContent = `${r.arm}: ${T} bits, ${T - wrong} of ${T} running answers right ` +
    `(token accuracy ${num(r.token_accuracy, 3)}${r.all_right ? ", every one" : ""}); the sign of the memory's ` +
    `determinant ${r.sign_is_parity ? "equals" : "does not follow"} (−1)^parity at every token.`;
  const svg = $("#tracking-chart");
  const F = frame(svg, [0, T], [-1.15, 1.6], { xlabel: "token", yticks: [-1, -0.5, 0, 0.5, 1] });
  const w = (F.x(1) - F.x(0));
  for (let t = 0; t < T; t++) {
    const e = r.eigenvalue[t];
    el("rect", { x: F.x(t) + 0.1 * w, y: Math.min(F.y(0), F.y(e)), width: Math.max(0.8 * w, 0.5),
                 height: Math.abs(F.y(e) - F.y(0)), fill: r.bits[t] === "1" ? ORANGE : BLUE, opacity: 0.75 }, F.g);
    el("rect", { x: F.x(t), y: F.y(1.55), width: Math.max(w, 0.5), height: F.y(1.25) - F.y(1.55),
                 fill: r.right[t] ? GREEN : RED }, F.g);
  }
  const pts = r.sign.map((s, t) => `${F.x(t + 0.5)},${F.y(s * 0.95)}`).join(" ");
  el("polyline", { points: pts, fill: "none", stroke: PURPLE, "stroke-width": 1.5 }, F.g);
  if (r.train_length < T) el("line", { x1: F.x(r.train_length), y1: F.y(-1.15), x2: F.x(r.train_length), y2: F.y(1.6),
                                        stroke: GRAY, "stroke-dasharray": "4 3" }, F.g);
  [["1-bit: 1 − β", ORANGE], ["0-bit: 1 − β", BLUE], ["sign of the determinant", PURPLE]].forEach(([text, color], i) => {
    el("text", { x: F.x(0) + 8 + 170 * i, y: F.y(-1.1), fill: color }, F.g, text);
  });
}

// ---------------------------------------------------------------------------

const PANELS = {
  interference: {
    params: () => paramsOf("interference", Object.keys(LAB.config.interference.fields)),
    draw: drawInterference,
  },
  geometry: {
    params: () => {
      const section = $("#geometry");
      const w = parseWrites($('[name="writes"]', section).value);
      const probe = $('[name="probe"]', section).value.trim().split(/[\s,;()]+/).filter((x) => x !== "").map(Number);
      return { keys: w.keys, values: w.values, beta: controlValue(section, "beta"), probe: [probe] };
    },
    draw: drawGeometry,
    reset: () => geometryDefaults(),
  },
  spotlight: {
    params: () => paramsOf("spotlight", Object.keys(LAB.config.spotlight.fields)),
    draw: drawSpotlight,
  },
  memory: {
    params: () => paramsOf("memory", Object.keys(LAB.config.memory.fields)),
    draw: drawMemory,
  },
  tracking: {
    params: () => paramsOf("tracking", Object.keys(LAB.config.tracking.fields)),
    draw: drawTracking,
  },
};

function geometryDefaults() {
  const section = $("#geometry");
  const f = LAB.config.geometry.fields;
  $('[name="writes"]', section).value = writesText(f.keys.default, f.values.default);
  $('[name="probe"]', section).value = f.probe.default[0].join(" ");
  $('[name="step"]', section).value = f.keys.default.length;
}

async function main() {
  try {
    LAB.config = await (await fetch("/api/config")).json();
  } catch (e) {
    $("#status").textContent = "could not reach the lab server: " + e;
    return;
  }
  for (const name of Object.keys(PANELS)) setupControls(name);
  geometryDefaults();
  for (const name of Object.keys(PANELS)) wire(name);
  const section = $("#geometry");
  $('[name="step"]', section).addEventListener("input", drawGeometryStep);
  const step = (d) => { const s = $('[name="step"]', section); s.value = Math.max(0, Math.min(Number(s.max), Number(s.value) + d)); drawGeometryStep(); };
  $(".prev", section).addEventListener("click", () => step(-1));
  $(".next", section).addEventListener("click", () => step(1));
  await Promise.all(Object.keys(PANELS).map(update));
  $("#status").textContent = "ready";
  document.body.dataset.ready = "1";
  LAB.timings.ready = performance.now();
}

main();
