// hetnode's live dashboard: polls the coordinator's JSON routes and draws the cluster. No library, no build.
//
// The API key (when the coordinator has one) comes from the URL fragment (#key=...) or the form, lives in
// sessionStorage (this tab only) and goes out as "Authorization: Bearer" on every poll; the fragment is never
// sent to the server, and the page removes it from the address bar. See hetnode/coordinator/dashboard.py.
// Every value shown is set with textContent or setAttribute, never parsed as HTML: node names come from joins.
"use strict";

const POLL_MS = 1000;
const KEY_ITEM = "hetnode-api-key";
const SVG_NS = "http://www.w3.org/2000/svg";
const CARD_W = 210, CARD_H = 92, GAP_Y = 22, TOP = 118, COORD_Y = 14, MIN_COL_W = 240;

class AuthError extends Error {}

function takeKeyFromFragment() {
  const params = new URLSearchParams(location.hash.slice(1));
  const key = params.get("key");
  if (key !== null) {
    sessionStorage.setItem(KEY_ITEM, key);
    history.replaceState(null, "", location.pathname + location.search);
  }
}

async function getJSON(path) {
  const key = sessionStorage.getItem(KEY_ITEM);
  const headers = key ? { Authorization: "Bearer " + key } : {};
  const response = await fetch(path, { headers, cache: "no-store" });
  if (response.status === 401) throw new AuthError("the API key is missing or wrong");
  const body = await response.json();
  if (!response.ok) throw new Error(body?.error?.message || path + ": HTTP " + response.status);
  return body;
}

// -- small DOM helpers ------------------------------------------------------------------------------------

function svg(tag, attrs = {}, text) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}

function html(tag, text, attrs = {}) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  return e;
}

function fmt(x, digits = 1) {
  return x === null || x === undefined || Number.isNaN(x) ? "–" : Number(x).toFixed(digits);
}

function ms(seconds) {
  return seconds === null || seconds === undefined ? "–" : (seconds * 1000).toFixed(0) + " ms";
}

function fillDl(dl, rows) {
  dl.replaceChildren(...rows.flatMap(([k, v]) => [html("dt", k), html("dd", v)]));
}

function clock(unix) {
  return new Date(unix * 1000).toLocaleTimeString([], { hour12: false });
}

// -- the graph --------------------------------------------------------------------------------------------

function nodeState(n) {
  return n.state === "up" && n.draining ? "draining" : n.state;
}

function layout(cluster, plan) {
  const firstLayer = new Map((plan?.plan?.shards || []).map((s) => [s.name, s.first_layer]));
  const regions = [...new Set(cluster.nodes.map((n) => n.region || "(no region)"))].sort();
  const colW = Math.max(MIN_COL_W, 1000 / Math.max(1, regions.length));
  const width = Math.max(1000, colW * regions.length);
  const pos = new Map();
  let rows = 1;
  regions.forEach((region, i) => {
    const members = cluster.nodes.filter((n) => (n.region || "(no region)") === region);
    // Pipeline order within a region: by the first layer each node holds, the rest after by name.
    members.sort((a, b) => (firstLayer.get(a.name) ?? 1e9) - (firstLayer.get(b.name) ?? 1e9)
      || a.name.localeCompare(b.name));
    members.forEach((n, j) => pos.set(n.name, { x: colW * (i + 0.5), y: TOP + 30 + j * (CARD_H + GAP_Y) + CARD_H / 2 }));
    rows = Math.max(rows, members.length);
  });
  pos.set("coordinator", { x: width / 2, y: COORD_Y + 30 });
  const height = TOP + 30 + rows * (CARD_H + GAP_Y) + 10;
  return { regions, colW, width, height, pos };
}

// Where the segment from a card's centre toward (tx, ty) leaves the card.
function border(p, tx, ty, halfW, halfH) {
  const dx = tx - p.x, dy = ty - p.y;
  if (dx === 0 && dy === 0) return { x: p.x, y: p.y };
  const s = Math.min(dx === 0 ? Infinity : halfW / Math.abs(dx), dy === 0 ? Infinity : halfH / Math.abs(dy));
  return { x: p.x + dx * s, y: p.y + dy * s };
}

function half(name) {
  return name === "coordinator" ? [80, 30] : [CARD_W / 2, CARD_H / 2];
}

// A gently curved edge between two cards; `bend` sets which side it bows to, so a flow and a link between
// the same two cards do not sit on each other.
function edgePath(a, b, pos, bend) {
  const pa = pos.get(a), pb = pos.get(b);
  const [aw, ah] = half(a), [bw, bh] = half(b);
  const mx = (pa.x + pb.x) / 2, my = (pa.y + pb.y) / 2;
  const len = Math.hypot(pb.x - pa.x, pb.y - pa.y) || 1;
  // Cards in one column are linked around their side, not through the cards between them.
  const sameColumn = Math.abs(pa.x - pb.x) < 1;
  const off = sameColumn ? bend * (CARD_W / 2 + 26) : bend * Math.min(40, len / 6);
  const cx = mx + (-(pb.y - pa.y) / len) * off, cy = my + ((pb.x - pa.x) / len) * off;
  const s = border(pa, cx, cy, aw, ah), e = border(pb, cx, cy, bw, bh);
  return { d: `M${s.x.toFixed(1)},${s.y.toFixed(1)} Q${cx.toFixed(1)},${cy.toFixed(1)} ${e.x.toFixed(1)},${e.y.toFixed(1)}`,
           label: { x: (s.x + 2 * cx + e.x) / 4, y: (s.y + 2 * cy + e.y) / 4 } };
}

function drawLinks(g, cluster, pos) {
  const pairs = new Map();
  for (const l of cluster.links) {
    if (!pos.has(l.src_name) || !pos.has(l.dst_name)) continue;
    const key = [l.src_name, l.dst_name].sort().join("\u0000");
    const entry = pairs.get(key) || { a: l.src_name, b: l.dst_name, bw: [] };
    entry.bw.push(l.bandwidth_mbps);
    pairs.set(key, entry);
  }
  for (const { a, b, bw } of pairs.values()) {
    const mean = bw.reduce((s, x) => s + x, 0) / bw.length;
    const p = edgePath(a, b, pos, 1);
    const width = Math.max(0.8, Math.min(4, Math.log10(Math.max(mean, 1))));
    g.append(svg("path", { class: "edge link", d: p.d, "stroke-width": width.toFixed(2),
                           "data-a": a, "data-b": b, "data-mbps": mean.toFixed(1) }));
    g.append(svg("text", { class: "edge-label", x: p.label.x, y: p.label.y, "text-anchor": "middle" },
                 mean >= 1000 ? (mean / 1000).toFixed(1) + " Gbit/s" : mean.toFixed(0) + " Mbit/s"));
  }
}

function drawFlows(g, plan, pos) {
  const flows = plan?.plan?.flows || [];
  const top = Math.max(1e-9, ...flows.map((f) => f.flow));
  const end = (name) => (name === "source" || name === "sink" ? "coordinator" : name);
  for (const f of flows) {
    const a = end(f.from), b = end(f.to);
    if (!pos.has(a) || !pos.has(b) || a === b) continue;
    // Token ids out of the coordinator and tokens back bow to different sides.
    const p = edgePath(a, b, pos, f.to === "sink" ? -2 : -1);
    g.append(svg("path", { class: "edge flow", d: p.d, "stroke-width": (1.5 + 6 * f.flow / top).toFixed(2),
                           "marker-end": "url(#arrow)", "data-from": f.from, "data-to": f.to }));
    g.append(svg("text", { class: "edge-label flow", x: p.label.x, y: p.label.y, "text-anchor": "middle" },
                 fmt(f.flow, 0) + " tok/s"));
  }
}

function drawNode(g, n, p, shard) {
  const state = nodeState(n);
  const node = svg("g", { class: "node st-" + state, "data-name": n.name, "data-state": state,
                          transform: `translate(${p.x - CARD_W / 2},${p.y - CARD_H / 2})` });
  node.append(svg("title", {}, `${n.name} (${n.peer_id})\n${n.state_reason || state}\n${(n.addrs || []).join("\n")}`));
  node.append(svg("rect", { class: "card", width: CARD_W, height: CARD_H, rx: 7 }));
  node.append(svg("text", { class: "name", x: 9, y: 17 }, n.name));
  node.append(svg("text", { class: "state", x: CARD_W - 9, y: 17, "text-anchor": "end" }, state));
  const prof = n.profile || {};
  const device = (prof.device_type || prof.device || "?") + (prof.num_devices > 1 ? " ×" + prof.num_devices : "")
    + (prof.emulated ? " (emulated)" : "");
  node.append(svg("text", { x: 9, y: 34 }, device));
  const a = n.assignment;
  let role = "no assignment";
  if (shard) role = `${shard.role} · layers ${shard.first_layer}–${shard.last_layer - 1}`;
  else if (a && a.last_layer > a.first_layer) role = `${a.role} · layers ${a.first_layer}–${a.last_layer - 1}`;
  else if (a) role = "idle";
  node.append(svg("text", { x: 9, y: 50 }, role));
  const load = n.load || {};
  node.append(svg("text", { x: 9, y: 66 }, `${load.queued_tokens ?? 0} queued tok · ${load.active_sessions ?? 0} sessions`));
  const blocks = (load.kv_blocks_used || 0) + (load.kv_blocks_free || 0);
  const share = blocks ? load.kv_blocks_used / blocks : 0;
  node.append(svg("rect", { class: "kv-bg", x: 9, y: 74, width: CARD_W - 70, height: 9, rx: 2 }));
  node.append(svg("rect", { class: "kv", x: 9, y: 74, width: ((CARD_W - 70) * share).toFixed(1), height: 9, rx: 2 }));
  node.append(svg("text", { x: CARD_W - 9, y: 83, "text-anchor": "end" }, `KV ${(100 * share).toFixed(0)}%`));
  g.append(node);
}

function drawGraph(cluster, plan) {
  const root = document.getElementById("graph");
  const L = layout(cluster, plan);
  root.setAttribute("viewBox", `0 0 ${L.width} ${L.height}`);
  const defs = svg("defs");
  // Sized in the drawing's units, not the stroke's: thick flows would otherwise get huge arrowheads.
  const marker = svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 11,
                                 markerHeight: 11, markerUnits: "userSpaceOnUse", orient: "auto-start-reverse" });
  marker.append(svg("path", { d: "M0,0 L10,5 L0,10 z", fill: "#2f6fd6" }));
  defs.append(marker);
  const regions = svg("g"), edges = svg("g"), nodes = svg("g");
  L.regions.forEach((r, i) => {
    const band = svg("g", { class: "region", "data-region": r });
    band.append(svg("rect", { x: L.colW * i + 8, y: TOP, width: L.colW - 16, height: L.height - TOP - 4, rx: 10 }));
    band.append(svg("text", { x: L.colW * (i + 0.5), y: TOP + 20, "text-anchor": "middle" }, r));
    regions.append(band);
  });
  drawLinks(edges, cluster, L.pos);
  drawFlows(edges, plan, L.pos);
  const shards = new Map((plan?.plan?.shards || []).map((s) => [s.name, s]));
  for (const n of cluster.nodes) drawNode(nodes, n, L.pos.get(n.name), shards.get(n.name));
  const c = L.pos.get("coordinator");
  const coord = svg("g", { class: "node coordinator", "data-name": "coordinator", transform: `translate(${c.x - 80},${c.y - 30})` });
  coord.append(svg("title", {}, cluster.coordinator?.peer_id || ""));
  coord.append(svg("rect", { class: "card", width: 160, height: 60, rx: 7 }));
  coord.append(svg("text", { class: "name", x: 80, y: 25, "text-anchor": "middle" }, "coordinator"));
  coord.append(svg("text", { x: 80, y: 44, "text-anchor": "middle" }, `${cluster.up} up · membership v${cluster.version}`));
  nodes.append(coord);
  root.replaceChildren(defs, regions, edges, nodes);
  document.getElementById("graph-caption").textContent =
    `${cluster.up} of ${cluster.nodes.length} nodes up · ${L.regions.length} regions · ${cluster.links.length} measured links`;
}

// -- the side panels ----------------------------------------------------------------------------------------

function spark(id, values, failed, asLine) {
  const root = document.getElementById(id);
  const top = Math.max(1e-9, ...values.filter((v) => v !== null));
  const w = 300 / Math.max(1, values.length);
  const parts = [];
  if (asLine) {
    const pts = values.map((v, i) => (v === null ? null : `${(i * w + w / 2).toFixed(1)},${(46 - 42 * v / top).toFixed(1)}`))
      .filter((p) => p !== null);
    if (pts.length) parts.push(svg("polyline", { points: pts.join(" ") }));
  } else {
    values.forEach((v, i) => {
      const h = 42 * v / top;
      parts.push(svg("rect", { x: i * w + 1, y: 46 - h, width: Math.max(1, w - 2), height: h }));
      const fh = 42 * (failed[i] || 0) / top;
      if (fh > 0) parts.push(svg("rect", { class: "failed", x: i * w + 1, y: 46 - fh, width: Math.max(1, w - 2), height: fh }));
    });
  }
  parts.push(svg("text", { x: 298, y: 11, "text-anchor": "end", "font-size": 10, fill: "#6b7686" },
                 asLine ? "max " + ms(values.some((v) => v !== null) ? top : null) : "max " + fmt(top, 0)));
  root.replaceChildren(...parts);
}

function drawStats(stats, cluster) {
  const r = stats.requests;
  document.getElementById("window").textContent = `(last ${fmt(r.window_s, 0)} s)`;
  const o = r.outcomes;
  const moves = cluster.moves || {};
  fillDl(document.getElementById("stats"), [
    ["rate", fmt(r.rate, 2) + " req/s"],
    ["output", fmt(r.output_tokens_per_s, 1) + " tokens/s"],
    ["TTFT p50 / p95", ms(r.ttft_s.p50) + " / " + ms(r.ttft_s.p95)],
    ["TPOT p50 / p95", ms(r.tpot_s.p50) + " / " + ms(r.tpot_s.p95)],
    ["outcomes", `${o.completed} completed · ${o.server_error} failed · ${o.client_error} refused · ${o.cancelled} left`],
    ["sessions", `${stats.sessions.active} active · ${stats.sessions.queued} queued`],
    ["KV in use", `${fmt(100 * stats.kv.used_share, 1)}% (${stats.kv.blocks_used} of ${stats.kv.blocks_used + stats.kv.blocks_free} blocks)`],
    ["moves", `${moves.with_kv ?? 0} with KV · ${moves.reprefilled ?? 0} re-prefilled`],
  ]);
  spark("spark-rate", r.series.map((b) => b.requests), r.series.map((b) => b.failed), false);
  spark("spark-ttft", r.series.map((b) => b.ttft_s), [], true);
}

function drawPlan(plan) {
  const dl = document.getElementById("plan");
  const body = document.querySelector("#history tbody");
  if (!plan) {
    fillDl(dl, [["model", "this coordinator serves no model"]]);
    body.replaceChildren();
    return;
  }
  document.getElementById("model").textContent = `${plan.model} · ${plan.num_layers} layers`;
  const p = plan.plan;
  fillDl(dl, p ? [
    ["version", `${p.version}${p.ready ? " (ready)" : " (loading)"}`],
    ["method", p.method + " · " + p.status],
    ["max flow", fmt(p.max_flow, 1) + " tokens/s" + (p.upper_bound !== null ? ` (bound ${fmt(p.upper_bound, 1)})` : "")],
    ["scheduler", `${p.scheduler.name} · ${p.scheduler.running} running · ${p.scheduler.queued} queued`],
    ["replicas", p.replicas.map((r) => `${r.role}: ${r.nodes.join("→")}`).join("; ") || "–"],
    ["workload", `${fmt(plan.workload.rate, 2)} req/s · prompt ${fmt(plan.workload.mean_input, 0)} · output ${fmt(plan.workload.mean_output, 0)} tokens`],
  ] : [["plan", plan.problem || "none yet"]]);
  const rows = plan.history.slice(-12).reverse().map((h) => {
    const tr = html("tr", undefined, { title: (h.shards || []).join(", ") });
    tr.append(html("td", h.version), html("td", clock(h.at)), html("td", h.method), html("td", fmt(h.max_flow, 1)),
              html("td", h.reason));
    return tr;
  });
  body.replaceChildren(...rows);
}

function drawNodeTable(cluster, plan, now) {
  const shards = new Map((plan?.plan?.shards || []).map((s) => [s.name, s]));
  const rows = cluster.nodes.map((n) => {
    const s = shards.get(n.name), a = n.assignment, l = n.load || {}, prof = n.profile || {};
    const state = nodeState(n);
    const tr = html("tr", undefined, { "data-name": n.name, "data-state": state });
    const layers = s ? `${s.first_layer}–${s.last_layer - 1}` : a && a.last_layer > a.first_layer ? `${a.first_layer}–${a.last_layer - 1}` : "–";
    tr.append(
      html("td", n.name), html("td", n.region), html("td", prof.device_type || prof.device),
      html("td", fmt(prof.memory_bytes / 2 ** 30, 0) + " GiB"),
      html("td", state + (n.state_reason ? ` (${n.state_reason})` : "")),
      html("td", s ? s.role : a ? a.role : "–"), html("td", layers),
      html("td", a ? a.state || "assigned" : "–"),
      html("td", l.queued_tokens ?? 0), html("td", l.active_sessions ?? 0),
      html("td", `${l.kv_blocks_used ?? 0} / ${(l.kv_blocks_used ?? 0) + (l.kv_blocks_free ?? 0)}`),
      html("td", fmt(Math.max(0, now - n.last_seen), 1) + " s ago"));
    return tr;
  });
  document.querySelector("#nodes tbody").replaceChildren(...rows);
}

// -- the loop ---------------------------------------------------------------------------------------------

function setStatus(state, text) {
  const s = document.getElementById("status");
  s.dataset.state = state;
  s.textContent = text;
}

function showKeyForm(show) {
  document.getElementById("keyform").hidden = !show;
}

async function poll() {
  try {
    const [cluster, stats] = await Promise.all([getJSON("/v1/cluster"), getJSON("/v1/stats")]);
    const plan = stats.serving ? await getJSON("/v1/plan") : null;
    showKeyForm(false);
    drawGraph(cluster, plan);
    drawStats(stats, cluster);
    drawPlan(plan);
    drawNodeTable(cluster, plan, stats.at);
    setStatus("live", "live · " + clock(stats.at));
  } catch (err) {
    if (err instanceof AuthError) {
      showKeyForm(true);
      setStatus("error", err.message);
    } else {
      setStatus("error", "no answer: " + err.message);
    }
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  takeKeyFromFragment();
  document.getElementById("keyform").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_ITEM, document.getElementById("key").value.trim());
    document.getElementById("key").value = "";
  });
  poll();
});
