"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const $ = (s) => document.querySelector(s);
function h(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v); else e.setAttribute(k, v);
  }
  for (const c of kids.flat()) if (c !== null && c !== undefined) e.append(c instanceof Node ? c : String(c));
  return e;
}
const fmt = (x) => (x === null || x === undefined ? "–" : Number.isInteger(x) ? String(x) : x.toFixed(3));

function header() {
  const mb = (D.file_bytes || 0) / 1e6;
  const sampled = D.shown_trajectories < D.total_trajectories
    ? `sampled: up to ${D.groups_per_iteration} groups per iteration` : "every trajectory";
  $("#head").append(
    h("h1", {}, `${D.run} — ${D.algorithm} on ${D.recipe}`),
    h("div", { class: "note" }, `${D.shown_trajectories} of ${D.total_trajectories} trajectories (${sampled}); `
      + `this file: ${mb.toFixed(2)} MB; model ${D.model}; run ${D.path}`));
}

function curves() {
  for (const [tag, pts] of Object.entries(D.curves)) {
    if (!pts.length) continue;
    const W = 260, H = 110, P = 22;
    const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(0, ...ys), y1 = Math.max(...ys, y0 + 1e-9);
    const X = (x) => P + (x1 === x0 ? 0 : (x - x0) / (x1 - x0)) * (W - 2 * P);
    const Y = (y) => H - P - ((y - y0) / (y1 - y0)) * (H - 2 * P);
    const ns = "http://www.w3.org/2000/svg";
    const svg = document.createElementNS(ns, "svg");
    svg.setAttribute("width", W); svg.setAttribute("height", H);
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", pts.map((p) => `${X(p[0])},${Y(p[1])}`).join(" "));
    line.setAttribute("fill", "none"); line.setAttribute("stroke", "#2563eb"); line.setAttribute("stroke-width", "1.5");
    svg.append(line);
    for (const [t, x, y] of [[fmt(y1), 2, P], [fmt(y0), 2, H - P], [`it ${x0}`, P, H - 4], [`it ${x1}`, W - P - 24, H - 4]]) {
      const tx = document.createElementNS(ns, "text");
      tx.setAttribute("x", x); tx.setAttribute("y", y); tx.setAttribute("font-size", "9"); tx.textContent = t;
      svg.append(tx);
    }
    $("#curves").append(h("div", { class: "curve" }, h("div", { class: "t" }, `${tag} (last ${fmt(ys[ys.length - 1])})`), svg));
  }
}

function shade(lp) {  // low probability -> redder
  const p = Math.exp(lp);
  return `rgba(220,40,40,${(0.85 * (1 - p)).toFixed(3)})`;
}

function stepDetail(s) {
  const action = h("pre", { class: "action" }, s.action.map(([t, lp]) => h("span", { style: `background:${shade(lp)}`, title: `logprob ${lp}` }, t)));
  return h("div", { class: "detail" },
    h("div", { class: "k" }, `observation (${s.obs_len} tokens, ${s.prefix_len} shared with the previous step)`),
    h("pre", {}, s.prefix ? h("span", { class: "prefix" }, "…" + s.prefix) : null, h("span", { class: "new" }, s.new)),
    h("div", { class: "k" }, `action (finish: ${s.finish}; shading: low logprob is red)`), action,
    s.calls.length ? h("div", { class: "k" }, "tool calls") : null,
    s.calls.map((c) => h("div", { class: "call" + (c.error ? " err" : "") }, `${c.name || "(malformed)"}${c.error ? " — " + c.error : ""}`)),
    s.feedback ? h("div", { class: "k" }, "feedback") : null, s.feedback ? h("pre", {}, s.feedback) : null,
    h("div", { class: "k" }, `reward ${fmt(s.reward)} · process ${JSON.stringify(s.process)} · advantage ${fmt(s.adv)} · policy v${s.version}`));
}

function stepList(t) {
  return h("div", { class: "steps" }, t.steps.map((s) => {
    const box = h("div", { class: "step" });
    let open = null;
    box.append(h("div", { class: "sh", onclick: () => {
      if (open) { open.remove(); open = null; } else { open = stepDetail(s); box.append(open); }
    } }, `step ${s.i} · reward ${fmt(s.reward)} · adv ${fmt(s.adv)} · ${s.calls.length} calls · v${s.version}`));
    return box;
  }));
}

function card(t) {
  const cls = "traj" + (t.success === true ? " ok" : t.success === false ? " bad" : "");
  const box = h("div", { class: cls, "data-id": t.id });
  let steps = null;
  box.append(h("div", { class: "sum", onclick: () => {  // steps are built when first opened
    if (steps) { steps.remove(); steps = null; } else { steps = stepList(t); box.append(steps); }
  } }, h("b", {}, t.id), h("br"),
    h("span", { class: "badge" }, `reward ${fmt(t.reward)}`),
    h("span", { class: "badge" }, t.success === null ? "unscored" : t.success ? "success" : "failure"),
    h("span", { class: "badge" }, `${t.steps.length} steps`), h("span", { class: "badge" }, `${t.calls} calls`),
    t.errors ? h("span", { class: "badge err" }, `${t.errors} errors`) : null,
    t.truncated ? h("span", { class: "badge trunc" }, "truncated") : null));
  return box;
}

function keep(t) {
  const f = $("#f-success").value, lo = parseFloat($("#f-rmin").value), hi = parseFloat($("#f-rmax").value);
  if (f === "yes" && t.success !== true) return false;
  if (f === "no" && t.success !== false) return false;
  if (!Number.isNaN(lo) && t.reward < lo) return false;
  if (!Number.isNaN(hi) && t.reward > hi) return false;
  if ($("#f-errors").checked && !t.errors) return false;
  if ($("#f-trunc").checked && !t.truncated) return false;
  return true;
}

function draw() {
  const main = $("#groups");
  main.replaceChildren();
  const which = $("#f-iter").value;
  let shown = 0;
  D.iterations.forEach((it, k) => {
    if (which !== "all" && String(k) !== which) return;
    const title = it.damaged ? `${it.kind} iteration ${it.it} — damaged, not shown: ${it.damaged}` : `${it.kind} iteration ${it.it} — ${it.groups.length} of ${it.total_groups} groups, ${it.total} trajectories`;
    const sec = h("section", { class: it.damaged ? "iter damaged" : "iter" }, h("h2", {}, title));
    for (const g of it.groups) {
      const ts = g.trajs.map((i) => D.trajs[i]).filter(keep);
      if (!ts.length) continue;
      shown += ts.length;
      sec.append(h("div", { class: "group" }, h("div", { class: "gh" }, `group ${g.id}`), h("div", { class: "cols" }, ts.map(card))));
    }
    main.append(sec);
  });
  $("#shown-count").textContent = shown;
}

header();
curves();
$("#f-iter").append(h("option", { value: "all" }, "all"), D.iterations.map((it, k) => h("option", { value: String(k) }, `${it.kind} ${it.it}`)));
for (const id of ["#f-iter", "#f-success", "#f-rmin", "#f-rmax", "#f-errors", "#f-trunc"]) $(id).addEventListener("input", draw);
draw();
