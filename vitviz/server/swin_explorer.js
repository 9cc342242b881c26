// vitviz's windowed explorer (a Swin), drawn in the browser (gr.HTML's js_on_load: `element`,
// `props` and `watch` are Gradio's). Every view is computed here from the 8-bit rows the server
// sends once per analysis (vitviz/server/pictures/swin_explorer.py), by the same rule as the server's own
// pictures, so both give the same pixels: value = q * rowmax / 255 on the layer's stage grid, shown
// on the finest grid (cell (r, c) shows the stage's token (r >> s, c >> s)); index = floor((v - lo) /
// (hi - lo) * 255 + 1/2); pixel = floor((2 * image + 3 * colour + 2) / 5); then the query's window
// (its visible tokens) outlined in cyan and the query token in white, `outline` px inside each edge
// whose neighbour lies outside.
(() => {
  const root = element.querySelector(".vvw");
  const mapCanvas = root.querySelector(".vvw-map");
  const barCanvas = root.querySelector(".vvw-bar");
  const layerInput = root.querySelector(".vvw-layer");
  const layerOut = root.querySelector(".vvw-layer-out");
  const headSelect = root.querySelector(".vvw-head");
  const scaleSelect = root.querySelector(".vvw-scale");
  const poolButton = root.querySelector(".vvw-pool");
  const queryText = root.querySelector(".vvw-query-text");
  const stageText = root.querySelector(".vvw-stage");
  const statusText = root.querySelector(".vvw-status");
  const ticks = root.querySelector(".vvw-ticks");
  const WINDOW = [0, 229, 255], QUERY = [255, 255, 255];

  let meta = null;        // the analysis' layout (props.value)
  let layers = [];        // per layer: its arrays
  let base = null;        // ImageData of the display image
  let pixelCell = null;   // Int32Array: the finest cell of each display pixel
  const view = { layer: 1, head: "mean", query: 0, pinned: false, scale: scaleSelect.value };
  let loading = 0;


  function imageData(url) {
    return new Promise((resolve, reject) => {
      const img = new Image();
      img.onload = () => {
        const c = document.createElement("canvas");
        c.width = img.naturalWidth;
        c.height = img.naturalHeight;
        const ctx = c.getContext("2d", { willReadFrequently: true });
        ctx.drawImage(img, 0, 0);
        resolve(ctx.getImageData(0, 0, c.width, c.height));
      };
      img.onerror = reject;
      img.src = url;
    });
  }

  function parseLayer(buffer, info) {
    // the layout of vitviz/server/pictures/swin_explorer.py, copied out of the buffer (typed arrays need aligned offsets)
    const n = info.grid[0] * info.grid[1], a = info.area, w = info.windows, v = info.heads + 2;
    let at = info.offset;
    const take = (Kind, count, bytes) => { const out = new Kind(buffer.slice(at, at + count * bytes)); at += count * bytes; return out; };
    const windowTokens = take(Int32Array, w * a, 4), tokenWindow = take(Int32Array, n, 4), tokenRegion = take(Int32Array, n, 4);
    const top = take(Float32Array, v * n, 4), q = take(Uint8Array, v * n * a, 1);
    const poolTop = take(Float32Array, v, 4), pool = take(Uint8Array, v * n, 1);
    // the stage's token over each finest cell
    const [gh, gw] = meta.grid, s = info.stage, stageOf = new Int32Array(gh * gw);
    for (let r = 0; r < gh; r++) for (let c = 0; c < gw; c++) stageOf[r * gw + c] = (r >> s) * info.grid[1] + (c >> s);
    return { ...info, n, windowTokens, tokenWindow, tokenRegion, top, q, poolTop, pool, stageOf };
  }

  async function load(value) {
    const ticket = ++loading;
    meta = value;
    layers = [];
    root.dataset.analysis = "";
    if (!meta || meta.mode !== "stack") {
      root.classList.toggle("vvw-off", true);
      statusText.textContent = meta ? meta.note : "Analyse an image first.";
      return;
    }
    root.classList.toggle("vvw-off", false);
    statusText.textContent = "";
    const [b, response] = await Promise.all([imageData(fileUrl(meta.base)), fetch(fileUrl(meta.data))]);
    if (!response.ok) { statusText.textContent = `The explorer's data could not be fetched (${response.status}): analyse the image again.`; return; }
    const buffer = await response.arrayBuffer();
    if (ticket !== loading) return;
    base = b;
    layers = meta.layers.map((info) => parseLayer(buffer, info));
    const side = base.width, px = meta.patch_px, gw = meta.grid[1], gh = meta.grid[0];
    pixelCell = new Int32Array(base.width * base.height);
    for (let y = 0; y < base.height; y++) {
      const r = Math.min(gh - 1, Math.floor(y / px)) * gw;
      for (let x = 0; x < side; x++) pixelCell[y * side + x] = r + Math.min(gw - 1, Math.floor(x / px));
    }
    layerInput.max = meta.depth;
    Object.assign(view, { layer: meta.depth, head: "mean", query: 0, pinned: false });
    layerInput.value = view.layer;
    draw();
    root.dataset.analysis = meta.id;
    root.dataset.grid = meta.grid.join("x");
  }

  function headNames(L) {
    return [...Array(L.heads).keys()].map((h) => `head ${h + 1}`).concat(["mean", "max"]);
  }

  function setupHeads(L) {
    const names = headNames(L);
    if (!names.includes(view.head)) view.head = "mean";
    if (headSelect.dataset.heads === String(L.heads)) { headSelect.value = view.head; return; }
    headSelect.innerHTML = "";
    names.forEach((name) => { const o = document.createElement("option"); o.value = name; o.textContent = name; headSelect.appendChild(o); });
    headSelect.dataset.heads = String(L.heads);
    headSelect.value = view.head;
  }

  function queryToken(L, query) {
    // the stage's token of query `query` (0: the pooled query, none)
    return query === 0 ? -1 : L.stageOf[query - 1];
  }

  function values(L, v, query) {
    const out = new Float64Array(L.n);
    const t = queryToken(L, query);
    if (t < 0) {
      const top = L.poolTop[v];
      for (let u = 0; u < L.n; u++) out[u] = L.pool[v * L.n + u] * top / 255;
      return out;
    }
    const row = v * L.n + t, top = L.top[row], start = row * L.area, w = L.tokenWindow[t];
    for (let p = 0; p < L.area; p++) {
      const u = L.windowTokens[w * L.area + p];
      if (u >= 0) out[u] = L.q[start + p] * top / 255;
    }
    return out;
  }

  function range(L, v, want) {
    if (want.scale === "map") return ownRange(v);
    let lo = Infinity, hi = -Infinity;
    for (let h = 0; h < L.heads + 2; h++) {
      const [a, b] = ownRange(values(L, h, want.query));
      lo = Math.min(lo, a); hi = Math.max(hi, b);
    }
    return [lo, hi];
  }

  function outline(img, L, inSet, color) {
    // the rule of vitviz.plots.outline_cells on the finest grid: a pixel of a cell in the set within
    // `outline` px of a side whose neighbour is outside the set (or off the grid)
    const [gh, gw] = meta.grid, px = meta.patch_px, w = meta.outline, d = img.data, side = img.width;
    const at = (r, c) => r >= 0 && c >= 0 && r < gh && c < gw && inSet[r * gw + c] === 1;
    for (let r = 0; r < gh; r++) {
      for (let c = 0; c < gw; c++) {
        if (!at(r, c)) continue;
        const left = !at(r, c - 1), right = !at(r, c + 1), up = !at(r - 1, c), down = !at(r + 1, c);
        if (!(left || right || up || down)) continue;
        for (let oy = 0; oy < px; oy++) {
          for (let ox = 0; ox < px; ox++) {
            if (!((left && ox < w) || (right && px - 1 - ox < w) || (up && oy < w) || (down && px - 1 - oy < w))) continue;
            const k = 4 * ((r * px + oy) * side + c * px + ox);
            d[k] = color[0]; d[k + 1] = color[1]; d[k + 2] = color[2];
          }
        }
      }
    }
  }

  function windowOf(L, t) {
    // the tokens the query token sees (same window, same region of the mask), as finest cells, and their bounding box on the stage grid
    const cells = new Uint8Array(meta.grid[0] * meta.grid[1]), mine = new Uint8Array(cells.length);
    let r0 = Infinity, c0 = Infinity, r1 = -1, c1 = -1;
    for (let u = 0; u < L.n; u++) {
      if (L.tokenWindow[u] !== L.tokenWindow[t] || L.tokenRegion[u] !== L.tokenRegion[t]) continue;
      const r = Math.floor(u / L.grid[1]), c = u % L.grid[1];
      r0 = Math.min(r0, r); c0 = Math.min(c0, c); r1 = Math.max(r1, r + 1); c1 = Math.max(c1, c + 1);
    }
    for (let f = 0; f < cells.length; f++) {
      const u = L.stageOf[f];
      cells[f] = L.tokenWindow[u] === L.tokenWindow[t] && L.tokenRegion[u] === L.tokenRegion[t] ? 1 : 0;
      mine[f] = u === t ? 1 : 0;
    }
    return { cells, mine, box: [r0, c0, r1, c1] };
  }

  function drawBar(lo, hi) { paintBar(barCanvas, ticks, meta.lut, lo, hi); }

  function draw() {
    if (!meta || meta.mode !== "stack" || !base) return;
    const L = layers[view.layer - 1];
    setupHeads(L);
    const want = { ...view };
    const v = headNames(L).indexOf(want.head);
    const vals = values(L, v, want.query);
    const [lo, hi] = range(L, vals, want);
    const img = new ImageData(base.width, base.height);
    const idx = indices(vals, lo, hi), fine = new Uint8Array(L.stageOf.length);  // each finest cell: its stage token's colour
    for (let f = 0; f < fine.length; f++) fine[f] = idx[L.stageOf[f]];
    blendCells(img, base, pixelCell, fine, meta.lut);
    const t = queryToken(L, want.query);
    let cell = "", box = "";
    if (t >= 0) {
      const seen = windowOf(L, t);
      outline(img, L, seen.cells, WINDOW);
      outline(img, L, seen.mine, QUERY);
      cell = `${Math.floor(t / L.grid[1])},${t % L.grid[1]}`;
      box = seen.box.join(",");
    }
    mapCanvas.width = base.width;
    mapCanvas.height = base.height;
    mapCanvas.getContext("2d").putImageData(img, 0, 0);
    drawBar(lo, hi);
    Object.assign(mapCanvas.dataset, { layer: String(want.layer), head: want.head, query: String(want.query), scale: want.scale, cell, window: box });
    layerOut.textContent = String(want.layer);
    const pinned = want.pinned ? " (pinned)" : "";
    if (t < 0) {
      queryText.textContent = `query: the mean of the final tokens (what the classifier reads)${pinned}`;
    } else {
      const r = Math.floor((want.query - 1) / meta.grid[1]), c = (want.query - 1) % meta.grid[1];
      const stage = L.stage ? ` (stage ${L.stage + 1} token row ${Math.floor(t / L.grid[1]) + 1}, column ${t % L.grid[1] + 1})` : "";
      queryText.textContent = `query: patch row ${r + 1}, column ${c + 1}${stage}${pinned}`;
    }
    const shifted = L.shift[0] || L.shift[1] ? `, shifted by ${L.shift[0]}x${L.shift[1]} (a token attends within its region of the mask)` : "";
    stageText.textContent = `Layer ${want.layer}: stage ${L.stage + 1}, a ${L.grid[0]}x${L.grid[1]} grid of tokens of ` +
      `${meta.patch_size << L.stage} px, ${L.heads} heads, windows ${L.window[0]}x${L.window[1]}${shifted}.`;
  }

  // hover, click and keys on the map (`wireMap`): query 0 is the pooled query, then the finest
  // cells; an arrow moves the query by one token of the layer's stage
  wireMap(mapCanvas, view, { ready: () => Boolean(meta && base), first: () => 1, grid: () => meta.grid, patchPx: () => meta.patch_px,
                             step: () => 1 << layers[view.layer - 1].stage, draw });
  poolButton.addEventListener("click", () => { Object.assign(view, { query: 0, pinned: true }); draw(); });
  layerInput.addEventListener("input", () => { view.layer = Number(layerInput.value); draw(); });
  headSelect.addEventListener("change", () => { view.head = headSelect.value; draw(); });
  scaleSelect.addEventListener("change", () => { view.scale = scaleSelect.value; draw(); });

  watch("value", () => load(props.value));
  load(props.value);
})();
