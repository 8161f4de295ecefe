// The EdgeTB dashboard: the live run (GET /api/view, then Server-Sent Events from /api/stream)
// or a stored run (GET /api/runs/<id>), drawn with uPlot (charts) and cytoscape (topology).
// window.edgetb exposes counters that the browser tests and bench/bench_dashboard.py read.
"use strict";
(() => {
  const E = window.edgetb = {updates: 0, lastRenderMs: 0, maxRenderMs: 0, loadMs: null, mode: null, runId: null,
    labelled: 0, view: () => view, apply: (u) => apply(u), drawn: () => drawn(), graph: () => cy};
  const MAX_ROWS = 300;       // table rows drawn at once (filter to see others)
  const FORCE_UP_TO = 150;    // a force layout up to this many nodes, a grid beyond
  const LOADS = ["idle", "u1", "u2", "u3", "down"];  // a link's class: idle, < 50, < 90, >= 90 % of its rate, cut
  const STATE_COLOURS = {running: "#4e79a7", done: "#59a14f", failed: "#e15759", paused: "#b07aa1",
    revoked: "#9c755f", crashed: "#9c755f", pending: "#bab0ac", stopped: "#bab0ac"};
  const UNMARKED = new Set(["done", "stopped"]);  // timeline kinds not marked on the charts
  const $ = (id) => document.getElementById(id);
  let view = null, stream = null, cy = null, graph = null, overlay = null, chosen = 0, linkSeries = null;
  let sortKey = "name", sortAsc = true, filterText = "";
  const charts = {};

  // formatting -----------------------------------------------------------------------------------
  const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;",
    '"': "&quot;", "'": "&#39;"}[c]));
  const si = (x, unit) => {
    if (x == null || !isFinite(x)) return "–";
    const steps = [[1e9, "G"], [1e6, "M"], [1e3, "k"]];
    for (const [f, p] of steps) if (Math.abs(x) >= f) return (x / f).toFixed(1) + " " + p + unit;
    return Math.round(x) + " " + unit;
  };
  const bytes = (x) => (x == null ? "–" : si(x, "B"));
  const bps = (x) => si(x, "bit/s");
  const num = (x, d) => (x == null || !isFinite(x) ? "–" : Number(x).toFixed(d));
  const stateClass = (s) => {
    s = String(s || "pending");
    for (const k of Object.keys(STATE_COLOURS)) if (s.startsWith(k)) return k;
    return s.startsWith("failed") || s === "timeout" || s === "lost" ? "failed" : "stopped";
  };

  function say(text, error) {
    const m = $("message");
    m.textContent = text || "";
    m.className = text ? "shown" + (error ? " error" : "") : "";
  }

  async function getJSON(url, options) {
    const r = await fetch(url, Object.assign({headers: {Accept: "application/json"}}, options || {}));
    const body = await r.json().catch(() => ({}));
    if (!r.ok) {
      const err = new Error(body.detail || body.message || body.error || ("HTTP " + r.status));
      err.status = r.status;
      throw err;
    }
    return body;
  }

  // charts ---------------------------------------------------------------------------------------
  function markers() {  // scenario and node events as dashed vertical lines on the time charts
    return {hooks: {draw: [(u) => {
      if (!view || !u.scales.x || u.series[0].label !== "t") return;
      const ctx = u.ctx, top = u.bbox.top, bottom = u.bbox.top + u.bbox.height;
      ctx.save();
      ctx.strokeStyle = "rgba(225,87,89,.55)";
      ctx.setLineDash([4, 4]);
      ctx.lineWidth = 1;
      for (const e of view.timeline) {
        if (e.t_s == null || UNMARKED.has(e.kind)) continue;
        const x = Math.round(u.valToPos(e.t_s, "x", true));
        if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
        ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, bottom); ctx.stroke();
      }
      ctx.restore();
    }]}};
  }

  function makeChart(id, xLabel, lines, band, yValues) {
    const el = $(id);
    el.textContent = "";
    const series = [{label: xLabel}];
    for (const [label, colour, dash] of lines) {
      series.push({label, stroke: colour, width: label.startsWith("p") ? 1 : 2, dash: dash || undefined,
        value: (u, v) => (yValues ? yValues(v) : num(v, 3))});
    }
    const opts = {width: Math.max(280, el.clientWidth || 320), height: 170, series, legend: {live: true},
      scales: {x: {time: false}}, plugins: [markers()],
      axes: [{label: xLabel === "t" ? "seconds since /start" : xLabel, size: 36},
             {size: yValues ? 84 : 48, values: (u, ticks) => ticks.map((v) => (yValues ? yValues(v) : v))}]};
    if (band) opts.bands = [{series: band, fill: "rgba(78,121,167,.15)"}];
    const empty = series.map(() => []);
    charts[id] = new uPlot(opts, empty, el);
  }

  function buildCharts() {
    const b = [["median", "#4e79a7"], ["p10", "rgba(78,121,167,.4)"], ["p90", "rgba(78,121,167,.4)"]];
    const accLines = overlay ? [...b, ["median of " + overlay.run_id, "#f28e2b", [6, 4]]] : b;
    makeChart("chart-acc-time", "t", accLines, [3, 2]);
    makeChart("chart-acc-round", "round", overlay ? [...b, ["median of " + overlay.run_id, "#f28e2b", [6, 4]]] : b,
      [3, 2]);
    makeChart("chart-loss-time", "t", b, [3, 2]);
    makeChart("chart-loss-round", "round", b, [3, 2]);
    makeChart("chart-throughput", "t", [["aggregate", "#4e79a7"]], null, (v) => bps(v));
    makeChart("chart-link", "t", [["measured", "#4e79a7"], ["rate", "#e15759", [6, 4]]], null, (v) => bps(v));
    // a recording's delay and loss as replayed on the link (shown when it has them)
    makeChart("chart-link-netem", "t", [["delay ms", "#59a14f"], ["loss %", "#b07aa1", [6, 4]]]);
    makeChart("chart-cpu", "t", b, [3, 2], (v) => num(v, 2));
    makeChart("chart-mem", "t", b, [3, 2], (v) => bytes(v));
  }

  function joined(base, extra) {  // two [x, ...ys] tables on one x axis
    return extra ? uPlot.join([base, extra]) : base;
  }

  function drawCharts() {
    const t = view.series.time, r = view.series.round;
    const ov = overlay && [overlay.time.t_s, overlay.time.acc_med];
    const ovr = overlay && [overlay.round.round, overlay.round.acc_med];
    charts["chart-acc-time"].setData(joined([t.t_s, t.acc_med, t.acc_lo, t.acc_hi], ov));
    charts["chart-acc-round"].setData(joined([r.round, r.acc_med, r.acc_lo, r.acc_hi], ovr));
    charts["chart-loss-time"].setData([t.t_s, t.loss_med, t.loss_lo, t.loss_hi]);
    charts["chart-loss-round"].setData([r.round, r.loss_med, r.loss_lo, r.loss_hi]);
    charts["chart-throughput"].setData([t.t_s, t.throughput_bps]);
    charts["chart-cpu"].setData([t.t_s, t.cpu_med, t.cpu_lo, t.cpu_hi]);
    charts["chart-mem"].setData([t.t_s, t.mem_med, t.mem_lo, t.mem_hi]);
    if (linkSeries) charts["chart-link"].setData([linkSeries.t_s, linkSeries.bps, linkSeries.rates]);
    const netem = !!(linkSeries && linkSeries.delay_ms);
    $("chart-link-netem").hidden = !netem;
    if (netem) charts["chart-link-netem"].setData([linkSeries.t_s, linkSeries.delay_ms, linkSeries.loss_pct]);
  }

  // the link chart -------------------------------------------------------------------------------
  function fillLinkSelect() {
    const sel = $("link-select");
    sel.textContent = "";
    const frag = document.createDocumentFragment();
    view.links.forEach((l, i) => {
      const o = document.createElement("option");
      o.value = String(i);
      o.textContent = l.src + " → " + l.dst;
      frag.appendChild(o);
    });
    sel.appendChild(frag);
    chosen = Math.min(chosen, Math.max(0, view.links.length - 1));
    sel.value = String(chosen);
  }

  async function loadLink(i) {
    chosen = i;
    $("link-select").value = String(i);
    const l = view.links[i];
    if (!l) return;
    const q = "src=" + encodeURIComponent(l.src) + "&dst=" + encodeURIComponent(l.dst) +
      (view.live ? "" : "&run=" + encodeURIComponent(view.run_id));
    try {
      linkSeries = await getJSON("/api/link?" + q);
      // a stored run's link has one rate; a live one's the rate of each sample (later samples add theirs)
      if (!linkSeries.rates) linkSeries.rates = linkSeries.t_s.map(() => linkSeries.rate_bps);
      drawCharts();
    } catch (e) { say("link " + l.src + " → " + l.dst + ": " + e.message, true); }
  }

  // the topology ---------------------------------------------------------------------------------
  function graphMode() {  // what the panel shows: the learning structure, or the network (links)
    const st = window.edgetbLayout.structure(view);
    const mode = st.kind === "mesh" ? "network" : $("graph-network").checked ? "network" : "structure";
    const dense = view.links.length > Math.max(100, 4 * view.nodes.length);
    const hideIdle = !$("graph-idle").checked && (mode === "structure" || dense);
    $("graph-network").disabled = st.kind === "mesh";
    return {st, mode, hideIdle};
  }

  function buildGraph() {
    const L = window.edgetbLayout, n = view.nodes.length;
    const {st, mode, hideIdle} = graphMode();
    graph = {st, mode, hideIdle};
    const maxRate = Math.max(1, ...view.snapshot.link_rate_bps.map((x) => x || 0));
    const children = new Map();
    for (const [child, parent] of st.edges) children.set(parent, (children.get(parent) || 0) + 1);
    const elements = view.nodes.map((node, k) => {
      const layers = st.layers.get(node.name) || [];
      const agg = mode === "structure" && st.kind !== "ring" && (children.has(node.name) || (layers[0] || 1) > 1);
      const text = node.name + (mode === "structure" && layers.length > 1 ? " · L" + layers.join(",") : "");
      return {data: {id: "n:" + node.name, label: node.name, k, text, tag: "", fs: L.LABEL_PX, gap: 0, back: 0,
        d: agg ? L.D_AGG : L.D, layers: layers.join(",")},
        classes: (agg ? "agg" : "") + (layers.length > 1 && mode === "structure" ? " multi" : "")};
    });
    // in the structure view a link along a structure edge colours that edge (its load, or down)
    const along = new Map(mode === "structure" ? st.edges.flatMap(([a, b], k) => [[a + "\u0000" + b, k],
      [b + "\u0000" + a, k]]) : []);
    graph.along = view.links.map((l) => along.get(l.src + "\u0000" + l.dst) ?? -1);
    view.links.forEach((l, i) => {
      const rate = view.snapshot.link_rate_bps[i] || 0;
      elements.push({data: {id: "l:" + i, source: "n:" + l.src, target: "n:" + l.dst, i,
        w: 1 + 3 * Math.log10(1 + 9 * rate / maxRate)}, classes: mode === "structure" ?
        (graph.along[i] >= 0 ? "along" : "link") : ""});
    });
    const box = $("graph"), W = box.clientWidth || 600, H = box.clientHeight || 460;
    const placed = L.layout(st, mode, W, H) || (n > FORCE_UP_TO ? L.grid(st.names, W, H) : null);
    if (mode === "structure") {  // a leaf of a tree hangs from a comb: no edge across its neighbours
      st.edges.forEach(([child, parent], i) => {
        const comb = placed.comb && placed.comb.has(child) && st.up.get(child) === parent;
        elements.push({data: {id: "s:" + i, source: "n:" + child, target: "n:" + parent},
          classes: "struct" + (comb ? " comb" : "")});
      });
    }
    if (placed) {
      placed.axis.forEach((a, i) => elements.push({data: {id: "axis:" + i, text: a.label, tag: "", fs: L.LABEL_PX,
        d: 1, gap: 0, back: 0}, classes: "axis", position: {x: a.x, y: a.y}}));
      for (const el of elements) {
        const p = el.data.id.startsWith("n:") && placed.pos.get(el.data.label);
        if (p) el.position = {x: p.x, y: p.y};
      }
    } else {  // a force layout starts from a circle
      elements.forEach((el, k) => {
        if (el.data.id.startsWith("n:")) el.position = {x: 300 * Math.cos(k), y: 300 * Math.sin(k)};
      });
    }
    if (cy) cy.destroy();
    cy = cytoscape({container: box, elements, style: L.style(n, hideIdle, STATE_COLOURS), minZoom: 0.02, maxZoom: 8,
      textureOnViewport: n > 300, hideEdgesOnViewport: n > 300, layout: {name: "preset"}});
    graph.nodes = cy.nodes().filter((x) => !x.hasClass("axis"));
    graph.sides = placed ? placed.side : new Map();
    if (!placed) {
      const pts = graph.nodes.map((x) => Object.assign({}, x.position()));
      cy.layout({name: "cose", animate: false, randomize: false, numIter: 800, nodeRepulsion: 8000,
        nodeDimensionsIncludeLabels: false}).run();
      graph.nodes.forEach((x, k) => { pts[k] = Object.assign({}, x.position()); });
      L.separate(pts, L.PX);
      cy.batch(() => graph.nodes.forEach((x, k) => x.position(pts[k])));
    }
    const pad = 12 + Math.min(80, L.maxTextWidth(cy.nodes().map((x) => x.data("text"))));  // room for the labels
    cy.fit(undefined, pad);
    if (cy.zoom() > L.ZOOM_CAP) { cy.zoom(L.ZOOM_CAP); cy.center(); }
    placeLabels();
    let pending = null;
    cy.on("zoom", () => { clearTimeout(pending); pending = setTimeout(placeLabels, 120); });
    const tip = document.createElement("div");
    tip.id = "tooltip";
    box.appendChild(tip);
    cy.on("mouseover", "node", (ev) => {
      const i = ev.target.data("k");
      if (i == null) return;
      const s = view.snapshot, node = view.nodes[i], layers = ev.target.data("layers");
      tip.textContent = node.name + (node.role ? " · " + node.role : "") + (layers ? " · layer " + layers : "") +
        " · " + s.state[i] + " · round " + s.round[i] + " · acc " + num(s.global_accuracy[i] ?? s.accuracy[i], 3);
      const p = ev.renderedPosition;
      tip.style.left = (p.x + 10) + "px"; tip.style.top = (p.y + 10) + "px"; tip.style.display = "block";
    });
    cy.on("mouseout", "node", () => { tip.style.display = "none"; });
    cy.on("tap", "edge", (ev) => { if (ev.target.data("i") != null) loadLink(ev.target.data("i")); });
    cy.on("tap", "node", (ev) => {  // a node's links and neighbours stand out; a tap elsewhere undoes it
      cy.batch(() => {
        cy.elements().addClass("faded").removeClass("focus");
        ev.target.closedNeighborhood().removeClass("faded");
        ev.target.addClass("focus");
      });
    });
    cy.on("tap", (ev) => { if (ev.target === cy) cy.elements().removeClass("faded focus"); });
    updateGraph();
  }

  function placeLabels() {  // the names that fit at this zoom, on one size on screen; the others on hover
    const L = window.edgetbLayout, zoom = cy.zoom();
    const axis = cy.nodes(".axis"), all = axis.union(graph.nodes.sort((a, b) => b.data("d") - a.data("d")));
    const items = all.map((x) => ({x: x.position("x"), y: x.position("y"), r: x.data("d") / 2 +
      (x.hasClass("multi") ? 4 : x.hasClass("agg") ? 2 : 0), text: x.data("text"), fixed: x.hasClass("axis"),
      side: x.hasClass("axis") ? "l" : graph.sides.get(x.data("label")) || "b"}));
    const sides = L.labels(items, zoom);
    const fs = L.LABEL_PX / zoom, gap = L.LABEL_GAP_PX / zoom;
    cy.batch(() => all.forEach((x, k) => {
      const s = sides[k], tag = s ? x.data("text") : "";
      if (x.data("tag") !== tag || x.data("fs") !== fs) x.data({tag, fs, gap, back: -gap});
      const cls = s ? "ls-" + s : null, old = x.scratch("_side");
      if (old !== cls) { if (old) x.removeClass(old); if (cls) x.addClass(cls); x.scratch("_side", cls); }
    }));
    E.labelled += 1;
  }

  function drawn() {  // the topology as drawn, in pixels of the panel (the browser tests read it)
    if (!cy) return {nodes: [], axis: []};
    const label = (x) => {
      if (!x.data("tag")) return null;
      const b = x.renderedBoundingBox({includeNodes: false, includeEdges: false, includeLabels: true, includeOverlays: false});
      return {x1: b.x1, y1: b.y1, x2: b.x2, y2: b.y2};
    };
    return {mode: graph.mode, kind: graph.st.kind, zoom: cy.zoom(),
      nodes: graph.nodes.map((x) => ({name: x.data("label"), x: x.renderedPosition("x"), y: x.renderedPosition("y"),
        r: x.renderedOuterWidth() / 2, layers: x.data("layers"), label: label(x)})),
      axis: cy.nodes(".axis").map((x) => ({text: x.data("text"), label: label(x)})),
      edges: cy.edges().filter((e) => e.visible()).length};
  }

  function swap(element, cls) {  // the state or load class, leaving the others (faded, focus) alone
    const old = element.scratch("_cls");
    if (old === cls) return;
    if (old) element.removeClass(old);
    if (cls) element.addClass(cls);
    element.scratch("_cls", cls);
  }

  function updateGraph() {
    const s = view.snapshot;
    const down = new Set(s.link_down);
    let busy = 0;
    const worst = graph.st.edges.map(() => 0);  // of the links along each structure edge
    cy.batch(() => {
      graph.nodes.forEach((node) => swap(node, stateClass(s.state[node.data("k")])));
      cy.edges().forEach((edge) => {
        const i = edge.data("i");
        if (i == null) return;
        const rate = s.link_rate_bps[i], b = s.link_bps[i] || 0;
        const u = rate ? b / rate : 0;
        const load = down.has(i) ? 4 : b < 1000 ? 0 : u < 0.5 ? 1 : u < 0.9 ? 2 : 3;
        if (load) busy += 1;
        if (graph.along[i] >= 0) worst[graph.along[i]] = Math.max(worst[graph.along[i]], load);
        swap(edge, LOADS[load]);
      });
      cy.edges(".struct").forEach((edge) => {
        const load = worst[Number(edge.id().slice(2))];
        swap(edge, load ? LOADS[load] : null);
      });
    });
    const idle = view.links.length - busy, st = graph.st;
    const what = st.kind === "mesh" ? "" : graph.mode === "structure" ? {tree: "E-tree by layer", star: "FL: the " +
      "aggregator in the middle", ring: "ring all-reduce in ring order"}[st.kind] + " · " : "the network · ";
    $("graph-note").textContent = what + view.nodes.length + " nodes · " + view.links.length + " links, " + busy +
      " carrying traffic, " + idle + " idle" + (graph.hideIdle && idle ? " (hidden)" : "");
  }

  // the nodes table ------------------------------------------------------------------------------
  function rows() {
    const s = view.snapshot;
    return view.nodes.map((n, i) => ({name: n.name, host: n.host, kind: n.kind, role: n.role, layer: n.layer,
      round: s.round[i], accuracy: s.accuracy[i], global_accuracy: s.global_accuracy[i], loss: s.loss[i],
      strategy: (s.strategy || [])[i],
      cpu_cores: s.cpu_cores[i], mem_bytes: s.mem_bytes[i], tx_bytes: s.tx_bytes[i], rx_bytes: s.rx_bytes[i],
      state: s.state[i]}));
  }

  function drawTable() {
    let all = rows();
    if (filterText) {
      const f = filterText.toLowerCase();
      all = all.filter((r) => [r.name, r.role, r.state, r.host, r.kind].some((v) => String(v ?? "").toLowerCase().includes(f)));
    }
    const dir = sortAsc ? 1 : -1;
    all.sort((a, b) => {
      const x = a[sortKey], y = b[sortKey];
      if (x == null && y == null) return 0;
      if (x == null) return 1;
      if (y == null) return -1;
      if (typeof x === "number" && typeof y === "number") return (x - y) * dir;
      return String(x).localeCompare(String(y), undefined, {numeric: true}) * dir;
    });
    const shown = all.slice(0, MAX_ROWS);
    $("rows-note").textContent = all.length > MAX_ROWS ? "showing " + MAX_ROWS + " of " + all.length +
      " (filter or sort to see others)" : all.length + " nodes";
    $("nodes").tBodies[0].innerHTML = shown.map((r) => "<tr><td>" + esc(r.name) + "</td><td>" + esc(r.host) +
      "</td><td>" + esc(r.kind) + "</td><td>" + esc(r.role) + "</td><td>" + esc(r.layer) + "</td><td>" + esc(r.round) +
      "</td><td>" + num(r.accuracy, 3) + "</td><td>" + num(r.global_accuracy, 3) + "</td><td>" + num(r.loss, 3) +
      "</td><td>" + esc(r.strategy ?? "") + "</td><td>" + num(r.cpu_cores, 2) + "</td><td>" + bytes(r.mem_bytes) + "</td><td>" + bytes(r.tx_bytes) +
      "</td><td>" + bytes(r.rx_bytes) + "</td><td class=\"state-" + esc(stateClass(r.state)) + "\">" + esc(r.state) +
      "</td></tr>").join("");
    for (const th of document.querySelectorAll("#nodes th")) {
      th.classList.toggle("sorted", th.dataset.key === sortKey);
      th.classList.toggle("asc", th.dataset.key === sortKey && sortAsc);
    }
  }

  // header, timeline, runs -----------------------------------------------------------------------
  function drawHeader() {
    const s = view.snapshot;
    const models = view.models || [];  // (labels: "lenet5 · torch"; several: their count, each in the tooltip)
    $("run-title").textContent = "run " + view.run_id + " · " + (view.algorithm || "") +
      (models.length === 1 ? " · " + models[0] : models.length > 1 ? " · " + models.length + " models" : "") +
      (view.live ? "" : " · stored");
    $("run-title").title = models.join("\n");
    const ph = $("phase");
    ph.textContent = s.phase;
    ph.className = "badge " + s.phase;
    $("clock").textContent = "t = " + num(s.t_s, 0) + " s";
    const counts = {};
    for (const st of s.state) { const k = stateClass(st); counts[k] = (counts[k] || 0) + 1; }
    const top = Math.max(0, ...s.round);
    $("counts").textContent = "round " + top + " · " + Object.entries(counts).map(([k, v]) => v + " " + k).join(", ");
    $("controls").hidden = !view.live;
    $("btn-live").hidden = view.live || E.liveRun == null;
    $("link-form").hidden = !view.live;
  }

  function drawTimeline() {
    const items = view.timeline.slice(-500);
    $("timeline").innerHTML = items.map((e) => "<li><span class=\"t\">" + num(e.t_s, 1) + " s</span> <b>" +
      esc(e.kind) + "</b> " + esc(e.target) + " " + esc(e.detail) + "</li>").join("");
    const ol = $("timeline");
    ol.scrollTop = ol.scrollHeight;
  }

  async function loadRuns() {
    try {
      const r = await getJSON("/api/runs");
      E.liveRun = r.live_run;
      $("runs").tBodies[0].innerHTML = r.runs.map((x) => "<tr><td>" + esc(x.run_id) + (x.run_id === r.live_run ?
        " (live)" : "") + "</td><td>" + esc(x.algorithm) + "</td><td>" + esc(x.nodes) + "</td><td>" +
        num(x.duration_s, 1) + " s</td><td>" + num(x.accuracy_median, 3) + "</td><td>" + esc(x.ended) +
        "</td><td><button data-open=\"" + esc(x.run_id) + "\">open</button> <button data-overlay=\"" + esc(x.run_id) +
        "\">overlay accuracy</button></td></tr>").join("");
      if (view) drawHeader();
      return r;
    } catch (e) { say("runs: " + e.message, true); return {runs: [], live_run: null}; }
  }

  // loading and updating -------------------------------------------------------------------------
  function show(v) {
    const t0 = performance.now();
    view = v;
    E.mode = v.live ? "live" : "stored";
    E.runId = v.run_id;
    drawHeader();
    buildCharts();
    fillLinkSelect();
    buildGraph();
    drawTable();
    drawTimeline();
    drawCharts();
    if (view.links.length) loadLink(chosen);
    E.loadMs = performance.now() - t0;
  }

  function apply(u) {
    const t0 = performance.now();
    const t = view.series.time;
    for (const k of Object.keys(u.points)) t[k].push(...u.points[k]);
    view.series.round = u.round;
    view.snapshot = u.snapshot;
    view.phase = u.phase;
    view.ended = u.ended;
    u.nodes_layer.forEach((layer, i) => { view.nodes[i].layer = layer; });
    view.timeline.push(...u.events);
    view.samples = u.samples;
    if (linkSeries && linkSeries.delay_ms && u.points.t_s.length) {
      loadLink(chosen);  // a replayed delay and loss: their values come with the link's series
    } else if (linkSeries && u.points.t_s.length) {
      const i = chosen;
      linkSeries.t_s.push(u.snapshot.t_s);
      linkSeries.bps.push(u.snapshot.link_bps[i]);
      linkSeries.rates.push(u.snapshot.link_rate_bps[i]);
    }
    drawHeader();
    updateGraph();
    drawTable();
    if (u.events.length) drawTimeline();
    drawCharts();
    E.updates += 1;
    E.lastRenderMs = performance.now() - t0;
    E.maxRenderMs = Math.max(E.maxRenderMs, E.lastRenderMs);
  }

  function openStream() {
    if (stream) stream.close();
    const last = view.timeline.length ? view.timeline[view.timeline.length - 1].seq : 0;
    stream = new EventSource("/api/stream?samples=" + view.samples + "&events=" + last + "&phase=" +
      encodeURIComponent(view.phase));
    stream.onmessage = (m) => apply(JSON.parse(m.data));
    stream.onerror = () => {  // reconnect from where the page is, not from where it first was
      stream.close();
      stream = null;
      if (E.mode === "live" && !["finished", "reset", "failed"].includes(view.phase)) setTimeout(openStream, 2000);
    };
  }

  async function openLive() {
    if (stream) { stream.close(); stream = null; }
    try {
      show(await getJSON("/api/view"));
      openStream();
      return true;
    } catch (e) {
      say("live run: " + e.message, true);
      return false;
    }
  }

  async function openStored(runId) {
    if (stream) { stream.close(); stream = null; }
    say("opening run " + runId + "…");
    try {
      show(await getJSON("/api/runs/" + encodeURIComponent(runId)));
      say("");
    } catch (e) { say("run " + runId + ": " + e.message, true); }
  }

  let runs = {runs: [], live_run: null};

  async function route() {  // #run=<id>: a stored run; else the live run, or the newest stored one
    const m = /^#run=(.+)$/.exec(location.hash);
    if (m) return openStored(decodeURIComponent(m[1]));
    if (runs.live_run != null && await openLive()) return;
    if (runs.runs.length) { location.hash = "#run=" + encodeURIComponent(runs.runs[0].run_id); }
    else say("no live run and no stored run in dml_file/log/");
  }

  // controls -------------------------------------------------------------------------------------
  for (const b of document.querySelectorAll("#controls button")) {
    b.addEventListener("click", async () => {
      if (b.id === "btn-reset" && !confirm("Remove the testbed (nodes, links)? The run's files are kept.")) return;
      b.disabled = true;
      say(b.textContent + "…");
      try {
        const r = await getJSON(b.dataset.path, {method: "POST"});
        say(b.textContent + ": " + (r.phase || (r.reset ? "done" : JSON.stringify(r).slice(0, 200))));
        loadRuns();
      } catch (e) { say(b.textContent + ": " + e.message, true); }
      b.disabled = false;
    });
  }
  $("link-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const l = view.links[chosen], bw = $("link-rate").value.trim();
    if (!l || !bw) { say("choose a link and give a rate such as 5mbit", true); return; }
    try {
      await getJSON("/api/link", {method: "POST", headers: {"Content-Type": "application/json", Accept: "application/json"},
        body: JSON.stringify({src: l.src, dst: l.dst, bw})});
      say("link " + l.src + " → " + l.dst + " set to " + bw);
    } catch (e) { say("link " + l.src + " → " + l.dst + ": " + e.message, true); }
  });
  $("link-select").addEventListener("change", (ev) => loadLink(Number(ev.target.value)));
  $("filter").addEventListener("input", (ev) => { filterText = ev.target.value.trim(); drawTable(); });
  for (const th of document.querySelectorAll("#nodes th")) {
    th.addEventListener("click", () => {
      sortAsc = sortKey === th.dataset.key ? !sortAsc : true;
      sortKey = th.dataset.key;
      drawTable();
    });
  }
  $("runs").addEventListener("click", async (ev) => {
    const open = ev.target.dataset.open, over = ev.target.dataset.overlay;
    if (open) location.hash = "#run=" + encodeURIComponent(open);
    if (over) {
      try {
        const v = await getJSON("/api/runs/" + encodeURIComponent(over));
        overlay = {run_id: over, time: v.series.time, round: v.series.round};
        buildCharts();
        drawCharts();
        say("accuracy of run " + over + " overlaid (orange)");
      } catch (e) { say("run " + over + ": " + e.message, true); }
    }
  });
  $("btn-live").addEventListener("click", () => { history.pushState("", "", location.pathname); route(); });
  window.addEventListener("hashchange", route);
  for (const id of ["graph-network", "graph-idle"]) $(id).addEventListener("change", () => { if (view) buildGraph(); });
  window.addEventListener("resize", () => { if (view) { buildCharts(); drawCharts(); } });
  loadRuns().then((r) => { runs = r; return route(); });
})();
