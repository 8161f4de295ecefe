// Where the topology panel draws each node, by the run's learning structure: E-tree as a layered
// tree (root on top, each aggregator above its children, a node on several layers drawn once at its
// highest), FL as a star (the aggregator in the middle, trainers on rings around it), ring all-reduce
// as a circle in ring order; gossip, and the network view, by a force layout over the links (a grid
// beyond FORCE_UP_TO nodes). Positions are in model units, nodes at least a node and a label apart;
// cytoscape scales them to the panel. Labels keep one size on screen and are shown where they fit.
"use strict";
window.edgetbLayout = (() => {
  const D = 14, D_AGG = 22;     // node diameters: trainers and peers; aggregators
  const PX = 38, PY = 34;       // pitch of a grid of nodes with their labels
  const GAP = 18;               // between neighbouring blocks of a tree
  const ROW_GAP = 44;           // between a tree's layers
  const RING_PITCH = 24;        // between neighbours on a large ring (a small one: PX)
  const ZOOM_CAP = 1.6;         // a small run is not blown up beyond this
  const LABEL_PX = 11;          // label font size on screen, at every zoom
  const LABEL_GAP_PX = 6;       // between a node and its label, on screen
  const FONT = "Helvetica, Arial, sans-serif";
  const SIDES = ["b", "r", "t", "l"];  // label below, right of, above, left of its node
  const BUSY_EDGES_ABOVE = 300; // beyond this many nodes links are drawn fainter

  // the structure ---------------------------------------------------------------------------------
  function structure(view) {  // {kind: tree|star|ring|mesh, layers: name -> [layer], up: name -> name, edges}
    const names = view.nodes.map((n) => n.name), known = new Set(names);
    const layers = new Map(), up = new Map(), edges = [], seen = new Set();
    let placed = false;
    for (const node of view.nodes) {
      const places = (node.places || []).filter((p) => p && Number.isInteger(p.layer))
        .sort((a, b) => b.layer - a.layer);
      placed = placed || places.length > 0;
      layers.set(node.name, [...new Set(places.map((p) => p.layer))]);
      const top = places[0];
      up.set(node.name, top && known.has(top.up) && top.up !== node.name ? top.up : null);
      for (const p of places) {
        const key = node.name + "\u0000" + p.up;
        if (known.has(p.up) && p.up !== node.name && !seen.has(key)) { seen.add(key); edges.push([node.name, p.up]); }
      }
    }
    if (!placed && view.algorithm === "fl") {  // a run without places: the roles make the star
      const agg = view.nodes.find((n) => n.role === "fl_aggregator");
      if (agg) {
        for (const n of view.nodes) {
          layers.set(n.name, [n === agg ? 2 : 1]);
          if (n !== agg) { up.set(n.name, agg.name); edges.push([n.name, agg.name]); }
        }
        placed = true;
      }
    }
    const kind = !placed ? "mesh" : {etree: "tree", fl: "star", ring: "ring"}[view.algorithm] || "tree";
    for (const n of names) {  // a cycle of parents (a foreign run's file) is cut where it closes
      const path = new Set([n]);
      for (let p = up.get(n); p != null; p = up.get(p)) {
        if (p === n) { up.set(n, null); break; }
        if (path.has(p)) break;
        path.add(p);
      }
    }
    return {kind, names, layers, up, edges};
  }

  const topLayer = (st, n) => (st.layers.get(n) || [])[0] || 1;

  // a layered tree -----------------------------------------------------------------------------------
  function tree(st, W, H) {
    const children = new Map(), roots = [];
    for (const n of st.names) {
      const p = st.up.get(n);
      if (p == null) roots.push(n);
      else (children.get(p) || children.set(p, []).get(p)).push(n);
    }
    const ROOT = "\u0000";  // above the roots, not drawn
    children.set(ROOT, roots);
    const leafBlocks = (n) => {  // a node's children without children of their own, by layer
      const blocks = new Map();
      for (const k of children.get(n) || []) {
        if (children.has(k)) continue;
        const l = topLayer(st, k);
        (blocks.get(l) || blocks.set(l, []).get(l)).push(k);
      }
      return [...blocks.entries()].sort((a, b) => b[0] - a[0]);
    };
    const blocksOf = new Map([...children.keys()].map((n) => [n, leafBlocks(n)]));
    const layersUsed = [...new Set(st.names.map((n) => topLayer(st, n)))].sort((a, b) => b - a);
    const largest = Math.max(1, ...[...blocksOf.values()].flat().map(([, ks]) => ks.length));

    // a block of one column stands right of its parent, its comb's spine between them
    const blockWidth = (cols) => (cols === 1 ? 1.5 * PX : cols * PX);
    function measure(R) {  // widths of every subtree and the rows of each layer with R rows of leaves
      const width = new Map(), rows = new Map();
      const visit = (n) => {
        let w = 0, parts = 0;
        for (const k of children.get(n) || []) if (children.has(k)) { w += visit(k); parts += 1; }
        for (const [layer, ks] of blocksOf.get(n)) {
          const cols = Math.ceil(ks.length / R);
          w += blockWidth(cols); parts += 1;
          rows.set(layer, Math.max(rows.get(layer) || 1, Math.ceil(ks.length / cols)));
        }
        w = Math.max(n === ROOT ? 0 : PX + GAP, w + GAP * Math.max(0, parts - 1));
        width.set(n, w);
        return w;
      };
      visit(ROOT);
      const height = layersUsed.reduce((h, l) => h + (rows.get(l) || 1) * PY, 0) + ROW_GAP * (layersUsed.length - 1);
      return {R, width, rows, zoom: Math.min(ZOOM_CAP, W / (width.get(ROOT) + 2 * PX), H / (height + 2 * PY))};
    }
    W -= 3 * PX;  // the layers' names on the left
    let best = measure(1);
    for (let R = 2; R <= largest; R += 1) {
      const m = measure(R);
      if (m.zoom > best.zoom + 1e-9) best = m;
    }
    const rowY = new Map();
    let y = 0;
    for (const l of layersUsed) { rowY.set(l, y); y += (best.rows.get(l) || 1) * PY + ROW_GAP; }
    const pos = new Map(), side = new Map(), comb = new Set();
    const place = (n, x0) => {
      const kids = (children.get(n) || []).filter((k) => children.has(k));
      const blocks = blocksOf.get(n);
      const inner = kids.reduce((w, k) => w + best.width.get(k), 0) +
        blocks.reduce((w, [, ks]) => w + blockWidth(Math.ceil(ks.length / best.R)), 0) +
        GAP * Math.max(0, kids.length + blocks.length - 1);
      let x = x0 + (best.width.get(n) - inner) / 2;
      const start = x;
      for (const k of kids) { place(k, x); x += best.width.get(k) + GAP; }
      for (const [layer, ks] of blocks) {
        const cols = Math.ceil(ks.length / best.R);
        ks.forEach((k, i) => {
          pos.set(k, {x: x + (cols === 1 ? PX : (i % cols + 0.5) * PX), y: rowY.get(layer) + Math.floor(i / cols) * PY});
          side.set(k, "b");
          comb.add(k);
        });
        x += blockWidth(cols) + GAP;
      }
      if (n !== ROOT) {
        pos.set(n, {x: inner > 0 ? start + inner / 2 : x0 + best.width.get(n) / 2, y: rowY.get(topLayer(st, n))});
        side.set(n, "t");
      }
    };
    place(ROOT, 0);
    const left = Math.min(...[...pos.values()].map((p) => p.x)) - D_AGG;  // the layer's name left of this
    const axis = layersUsed.map((l) => ({label: "layer " + l, x: left, y: rowY.get(l)}));
    return {pos, side, axis, comb};
  }

  // a star and a circle --------------------------------------------------------------------------------
  function outward(angle) {
    const s = Math.sin(angle), c = Math.cos(angle);
    return s > 0.6 ? "b" : s < -0.6 ? "t" : c > 0 ? "r" : "l";
  }

  function star(st) {
    const centres = st.names.filter((n) => topLayer(st, n) > 1 || st.up.get(n) == null);
    const others = st.names.filter((n) => !centres.includes(n));
    const pos = new Map(), side = new Map();
    centres.forEach((n, i) => {
      const a = 2 * Math.PI * i / centres.length, r = centres.length > 1 ? PX * centres.length / (2 * Math.PI) : 0;
      pos.set(n, {x: r * Math.cos(a), y: r * Math.sin(a)});
      side.set(n, "t");
    });
    let radius = (centres.length > 1 ? PX * centres.length / (2 * Math.PI) : 0) + D_AGG / 2 + PY * 1.5;
    for (let i = 0; i < others.length;) {
      const capacity = Math.max(1, Math.floor(2 * Math.PI * radius / PX));
      const count = Math.min(capacity, others.length - i);
      for (let k = 0; k < count; k += 1, i += 1) {
        const a = -Math.PI / 2 + 2 * Math.PI * k / count;
        pos.set(others[i], {x: radius * Math.cos(a), y: radius * Math.sin(a)});
        side.set(others[i], outward(a));
      }
      radius += PY;
    }
    return {pos, side, axis: []};
  }

  function ring(st) {
    const order = [], done = new Set();
    for (const first of st.names) {  // each node's successor follows it; a node off the ring at the end
      for (let n = first; n != null && !done.has(n); n = st.up.get(n)) { order.push(n); done.add(n); }
    }
    const pitch = order.length <= 80 ? PX : RING_PITCH;
    const radius = Math.max(PX, pitch * order.length / (2 * Math.PI));
    const pos = new Map(), side = new Map();
    order.forEach((n, i) => {
      const a = -Math.PI / 2 + 2 * Math.PI * i / order.length;
      pos.set(n, {x: radius * Math.cos(a), y: radius * Math.sin(a)});
      side.set(n, outward(a));
    });
    return {pos, side, axis: []};
  }

  function grid(names, W, H) {  // many nodes of a mesh, in the order of the view
    const cols = Math.max(1, Math.round(Math.sqrt(names.length * (W / PX) / (H / PY))));
    const pos = new Map(), side = new Map();
    names.forEach((n, i) => { pos.set(n, {x: (i % cols) * PX, y: Math.floor(i / cols) * PY}); side.set(n, "b"); });
    return {pos, side, axis: []};
  }

  // no two nodes closer than dmin: pushes overlapping pairs apart (after a force layout) -------------
  function separate(points, dmin) {
    for (let round = 0; round < 60; round += 1) {
      const cells = new Map(), key = (x, y) => x + "," + y;
      points.forEach((p, i) => {
        const k = key(Math.floor(p.x / dmin), Math.floor(p.y / dmin));
        (cells.get(k) || cells.set(k, []).get(k)).push(i);
      });
      let moved = false;
      points.forEach((p, i) => {
        const cx = Math.floor(p.x / dmin), cy = Math.floor(p.y / dmin);
        for (let dx = -1; dx <= 1; dx += 1) for (let dy = -1; dy <= 1; dy += 1) {
          for (const j of cells.get(key(cx + dx, cy + dy)) || []) {
            if (j <= i) continue;
            const q = points[j];
            let ux = q.x - p.x, uy = q.y - p.y, d = Math.hypot(ux, uy);
            if (d >= dmin) continue;
            if (d < 1e-6) { ux = Math.cos(i + j); uy = Math.sin(i + j); d = 1; }
            const push = (dmin - d) / 2 + 0.01;
            p.x -= ux / d * push; p.y -= uy / d * push; q.x += ux / d * push; q.y += uy / d * push;
            moved = true;
          }
        }
      });
      if (!moved) return;
    }
  }

  // labels ------------------------------------------------------------------------------------------
  const ctx = document.createElement("canvas").getContext("2d");
  ctx.font = LABEL_PX + "px " + FONT;
  const widths = new Map();
  const textWidth = (t) => widths.get(t) ?? (widths.set(t, ctx.measureText(t).width), widths.get(t));

  // items: [{x, y, r, text, side, fixed}] in priority order (model units; fixed: on that side or not at
  // all); returns each one's side, or null
  // where its label would cover another node or label at this zoom
  const maxTextWidth = (texts) => Math.max(0, ...texts.map(textWidth));

  function labels(items, zoom) {
    const f = 1 / zoom, h = LABEL_PX * 1.25 * f, pad = 2 * f, cell = 60 * f;
    const grid = new Map();
    const cellsOf = (b) => {
      const out = [];
      for (let x = Math.floor(b.x1 / cell); x <= Math.floor(b.x2 / cell); x += 1) {
        for (let y = Math.floor(b.y1 / cell); y <= Math.floor(b.y2 / cell); y += 1) out.push(x + "," + y);
      }
      return out;
    };
    const add = (b) => { for (const k of cellsOf(b)) (grid.get(k) || grid.set(k, []).get(k)).push(b); };
    const free = (b) => cellsOf(b).every((k) => (grid.get(k) || []).every((o) =>
      o.owner === b.owner || o.x2 <= b.x1 || b.x2 <= o.x1 || o.y2 <= b.y1 || b.y2 <= o.y1));
    items.forEach((it, i) => { if (it.r > 0) add({x1: it.x - it.r - pad, x2: it.x + it.r + pad, y1: it.y - it.r - pad, y2: it.y + it.r + pad, owner: i}); });
    const box = (it, s, w, i) => {
      const g = it.r + LABEL_GAP_PX * f;
      const b = s === "b" ? {x1: it.x - w / 2, x2: it.x + w / 2, y1: it.y + g, y2: it.y + g + h}
        : s === "t" ? {x1: it.x - w / 2, x2: it.x + w / 2, y1: it.y - g - h, y2: it.y - g}
        : s === "r" ? {x1: it.x + g, x2: it.x + g + w, y1: it.y - h / 2, y2: it.y + h / 2}
        : {x1: it.x - g - w, x2: it.x - g, y1: it.y - h / 2, y2: it.y + h / 2};
      return {x1: b.x1 - pad, x2: b.x2 + pad, y1: b.y1 - pad, y2: b.y2 + pad, owner: i};
    };
    return items.map((it, i) => {
      const w = textWidth(it.text) * f;
      for (const s of it.fixed ? [it.side] : [it.side, ...SIDES.filter((x) => x !== it.side)]) {
        const b = box(it, s, w, i);
        if (free(b)) { add(b); return s; }
      }
      return null;
    });
  }

  // the panel's cytoscape style: n nodes; idle links hidden or faint; a colour per node state
  function style(n, hideIdle, stateColours) {
    const css = [
      {selector: "node", style: {"background-color": "#bab0ac", width: "data(d)", height: "data(d)",
        label: "data(tag)", "font-size": "data(fs)", "font-family": FONT, color: "#333", "text-events": "no"}},
      {selector: "node.agg", style: {"border-width": 2, "border-color": "#1f2933"}},
      {selector: "node.multi", style: {"border-width": 4, "border-style": "double"}},
      {selector: "node.ls-b", style: {"text-valign": "bottom", "text-halign": "center", "text-margin-y": "data(gap)"}},
      {selector: "node.ls-t", style: {"text-valign": "top", "text-halign": "center", "text-margin-y": "data(back)"}},
      {selector: "node.ls-r", style: {"text-valign": "center", "text-halign": "right", "text-margin-x": "data(gap)"}},
      {selector: "node.ls-l", style: {"text-valign": "center", "text-halign": "left", "text-margin-x": "data(back)"}},
      {selector: "node.axis", style: {"background-opacity": 0, "border-width": 0, color: "#7b8794", events: "no"}},
      {selector: "edge", style: {width: "data(w)", "line-color": "#d0d0d0", "curve-style": n > 100 ? "haystack" : "bezier",
        "target-arrow-shape": n > 100 ? "none" : "triangle", "target-arrow-color": "#d0d0d0", "arrow-scale": 0.6,
        opacity: 0.9}},
      {selector: "edge.link", style: {width: 1, "curve-style": "haystack", "target-arrow-shape": "none", opacity: 0.5}},
      {selector: "edge.idle", style: hideIdle ? {display: "none"} : {opacity: n > BUSY_EDGES_ABOVE ? 0.04 : 0.25, width: 1}},
      {selector: "edge.along", style: {display: "none"}},
      {selector: "edge.struct", style: {width: 1.3, "line-color": "#7b8794", "curve-style": "straight",
        "target-arrow-shape": n > BUSY_EDGES_ABOVE ? "none" : "triangle", "target-arrow-color": "#7b8794",
        "arrow-scale": 0.5, opacity: 0.8}},
      {selector: "edge.comb", style: {"curve-style": "taxi", "taxi-direction": "horizontal",
        "taxi-turn": PX / 2 + "px", "taxi-turn-min-distance": 0, "target-arrow-shape": "none"}},
      {selector: "edge.u1", style: {"line-color": "#76b7b2", "target-arrow-color": "#76b7b2"}},
      {selector: "edge.u2", style: {"line-color": "#f28e2b", "target-arrow-color": "#f28e2b"}},
      {selector: "edge.u3", style: {"line-color": "#e15759", "target-arrow-color": "#e15759"}},
      {selector: "edge.struct.u1, edge.struct.u2, edge.struct.u3", style: {width: 2}},
      {selector: "edge.down", style: {"line-color": "#e15759", "line-style": "dashed", opacity: 1}},
      {selector: "edge:selected", style: {"line-color": "#1f2933", "target-arrow-color": "#1f2933", width: 4}},
      {selector: ".faded", style: {opacity: 0.04}},
      {selector: "node.focus", style: {"border-width": 3, "border-color": "#1f2933"}},
    ];
    if (n > BUSY_EDGES_ABOVE) css.push({selector: "edge.u1", style: {opacity: 0.3}},
      {selector: "edge.u2, edge.u3", style: {opacity: 0.6}});
    for (const [k, colour] of Object.entries(stateColours)) {
      css.push({selector: "node." + k, style: {"background-color": colour}});
    }
    return css;
  }

  function layout(st, mode, W, H) {  // {pos, side, axis} in model units; null: run the force layout
    if (mode === "structure" && st.kind === "tree") return tree(st, W, H);
    if (mode === "structure" && st.kind === "star") return star(st);
    if (mode === "structure" && st.kind === "ring") return ring(st);
    return null;
  }

  return {D, D_AGG, PX, PY, ZOOM_CAP, LABEL_PX, LABEL_GAP_PX, FONT, structure, layout, grid, separate, labels, maxTextWidth, style};
})();
