// vitviz's attention explorer, drawn in the browser (gr.HTML's js_on_load: `element`, `props`,
// `watch` and `server` are Gradio's). Every view is computed here from the 8-bit rows the server
// writes once per analysis (vitviz/server/pictures/explorer_data.py; the layer shown first is fetched
// before the others, or its first view comes inline: `early`), by the same rule as the server's own
// pictures, so both give the same pixels: value = q * rowmax / 255; index = floor((v - lo) /
// (hi - lo) * 255 + 1/2); pixel = floor((2 * image + 3 * colour + 2) / 5).
(() => {
  const root = element.querySelector(".vvx");
  const mapCanvas = root.querySelector(".vvx-map");
  const barCanvas = root.querySelector(".vvx-bar");
  const mosaicCanvas = root.querySelector(".vvx-mosaic");
  const layerInput = root.querySelector(".vvx-layer");
  const layerOut = root.querySelector(".vvx-layer-out");
  const headSelect = root.querySelector(".vvx-head");
  const scaleSelect = root.querySelector(".vvx-scale");
  const prefixBox = root.querySelector(".vvx-prefix");
  const queryText = root.querySelector(".vvx-query-text");
  const statusText = root.querySelector(".vvx-status");
  const ticks = root.querySelector(".vvx-ticks");
  const mosaicNote = root.querySelector(".vvx-mosaic-note");

  // what is shown: the analysis' layout (its value), its layers, pictures and pixel-to-patch maps;
  // a new analysis is prepared beside them (`load`) and takes their place when its first view can be drawn
  let meta = null;          // the analysis' layout (props.value, or the early value: `early`)
  let layers = [];          // per layer: {top: Float32Array [V*N], q: Uint8Array [V*N*M]} or a Promise
  let sharedMax = null;     // Float32Array [N]
  let base = null;          // ImageData of the display image
  let tileBase = null;      // ImageData of a mosaic tile's image
  let pixelPatch = null;    // Int32Array: the patch of each display pixel
  let tilePatch = null;     // Int32Array: the patch of each tile pixel
  const view = { layer: 1, head: 0, query: 0, pinned: false, scale: scaleSelect.value };
  let loading = 0;          // the newest load
  let loadingId = null;     // the analysis it loads
  let named = 0;            // the newest analysis this page named (`vitvizTicket`)
  const RETRIES = 3;        // an explorer's data refused (the server busy): tried again after 1, 2 and 4 s
  const SETTLE_MS = 150;    // how long the view stays on a layer not fetched before its file is asked for ("layers")


  // a picture of `explorer_data.rgb_file` fetched as ImageData, each pixel drawn k x k times (`rgbPicture`)
  async function pictureData(url, k = 1) {
    const response = await fetch(url);
    if (!response.ok) throw new Error(`${response.status} for the explorer's pictures`);
    return rgbPicture(await response.arrayBuffer(), k);
  }

  const pictures = (paths) => Number.isInteger(paths.scale) && paths.scale > 0
    ? Promise.all([pictureData(fileUrl(paths.base), paths.scale), pictureData(fileUrl(paths.tile_base))])
    : Promise.reject(new Error("the explorer's pictures came without their scale"));

  // the patch under each pixel of a picture of the grid's shape (w x h, each patch w / gw px wide)
  function patchIndex(w, h, grid) {
    const per = w / grid[1];
    const out = new Int32Array(w * h);
    for (let y = 0; y < h; y++) {
      const r = Math.min(grid[0] - 1, Math.floor(y / per)) * grid[1];
      for (let x = 0; x < w; x++) out[y * w + x] = r + Math.floor(x / per);
    }
    return out;
  }

  function parseLayer(m, buffer, offset) {
    const v = m.views, n = m.tokens, p = m.patches;
    const top = new Float32Array(buffer.slice(offset, offset + 4 * v * n));
    const q = new Uint8Array(buffer, offset + 4 * v * n, v * n * p);
    return [{ top, q }, offset + 4 * v * n + v * n * p];
  }

  async function fetchBuffer(url) {
    const response = await fetch(url);
    if (!response.ok) throw new Error(`${response.status} for the explorer's data`);
    return response.arrayBuffer();
  }

  // bytes [start, end) of the file: an HTTP Range request (Gradio's file route answers 206); a server
  // that sends the whole file instead (200) is read from it
  async function fetchRange(url, start, end) {
    const response = await fetch(url, { headers: { Range: `bytes=${start}-${end - 1}` } });
    if (!response.ok) throw new Error(`${response.status} for the explorer's data`);
    const buffer = await response.arrayBuffer();
    return response.status === 206 ? buffer : buffer.slice(start, end);
  }

  // the "stack" file's parts for layout `m`: the shared maxima (float32 [N]) at its start, then one
  // block a layer: float32 row maxima [V, N] and uint8 rows [V, N, M]
  const stackSizes = (m) => ({ head: 4 * m.tokens, block: m.views * m.tokens * (4 + m.patches) });

  // the other layers of an analysis that came early wait until the analysis' outputs have come, a
  // layer is asked for, or LATER ms have passed: fetched at once, they share the machine with the
  // rest of the analysis and delay its outputs (`vitviz.dev.bench --browser`)
  const LATER = 1500;
  let waiting = null;       // {id, go}: the analysis whose other layers wait, and what starts them
  function later(id) {
    return new Promise((resolve) => {
      const go = () => { if (waiting && waiting.id === id) waiting = null; resolve(); };
      waiting = { id, go };
      setTimeout(go, LATER);
    });
  }
  const release = (id) => { if (waiting && waiting.id === id) waiting.go(); };

  // the first view of an analysis that came early (`first`, base64: `explorer_data.first_shown`):
  // the shared maxima, the last layer's row maxima, and that layer's row of token `only` in every
  // view; the layer, with that one row filled in, stands for the whole until `full` brings it
  function partialLayer(m, first, only = 0) {
    const v = m.views, n = m.tokens, p = m.patches;
    const bytes = Uint8Array.from(atob(first), (c) => c.charCodeAt(0));
    if (bytes.length !== 4 * n + 4 * v * n + v * p) throw new Error("the explorer's first view is incomplete");
    const top = new Float32Array(bytes.buffer.slice(4 * n, 4 * n + 4 * v * n));
    const q = new Uint8Array(v * n * p);
    for (let h = 0; h < v; h++) q.set(bytes.subarray(4 * n + 4 * v * n + h * p, 4 * n + 4 * v * n + (h + 1) * p), (h * n + only) * p);
    return { sharedMax: new Float32Array(bytes.buffer.slice(0, 4 * n)), layer: { top, q, only, full: null } };
  }

  // the "stack" file of `next` (an analysis being loaded): the shared maxima and the layer shown first
  // (the last) fetched first, then the other layers in one request; a layer asked for meanwhile waits
  // for them. Early (`first`), the first view came inline: the whole last layer and the others are
  // fetched later (`later`), in two requests, the last layer's first
  function fetchStack(next, first) {
    const m = next.meta, url = fileUrl(m.data);
    const { head, block } = stackSizes(m), last = m.depth - 1;
    let go = null;
    if (first) {
      go = later(m.id);
      let given;
      try {
        given = partialLayer(m, first);
      } catch (error) {
        next.layers[last] = Promise.reject(error);
        next.layers[last].catch(() => {});
        return;
      }
      next.sharedMax = given.sharedMax;
      const full = go.then(() => stackBlock(m, m.depth));
      given.layer.full = full;
      next.layers[last] = Promise.resolve(given.layer);
      full.then((layer) => { next.layers[last] = layer; }, () => { given.layer.full = null; });  // failed: asked for again when needed
      next.whole = full;
    } else {
      next.layers[last] = fetchLayer(m, m.depth).then((got) => {
        next.sharedMax = got.sharedMax;
        if (meta === m) sharedMax = next.sharedMax;
        return got.layer;
      });
    }
    if (last > 0) {
      const rest = Promise.all([next.layers[last], go]).then(() => fetchRange(url, head, head + last * block)).then((buffer) => {
        const parsed = [];
        for (let l = 0, offset = 0; l < last; l++) [parsed[l], offset] = parseLayer(m, buffer, offset);
        return parsed;
      });
      for (let l = 0; l < last; l++) next.layers[l] = rest.then((parsed) => parsed[l]);
    }
    next.layers.forEach((p) => p.catch(() => {}));  // a failure is reported when its layer is drawn
    // data-complete: every layer is in, the last one whole (what a benchmark waits for before timing anything else)
    Promise.all([...next.layers, next.whole]).then(() => { next.complete = true; if (meta === m) root.dataset.complete = m.id; }, () => {});
  }

  // layer `layer`'s block of `m`'s "stack" file
  function stackBlock(m, layer) {
    const { head, block } = stackSizes(m);
    return fetchRange(fileUrl(m.data), head + (layer - 1) * block, head + layer * block).then((buffer) => parseLayer(m, buffer, 0)[0]);
  }

  // one layer of `m`'s analysis by itself: its block of the "stack" file, or its own file ("layers")
  async function fetchLayer(m, layer) {
    const { head } = stackSizes(m);
    if (m.mode === "stack") {
      const [top, parsed] = await Promise.all([fetchRange(fileUrl(m.data), 0, head), stackBlock(m, layer)]);
      return { layer: parsed, sharedMax: new Float32Array(top) };
    }
    const path = await server.explorer_layer(m.id, layer);
    if (typeof path !== "string" || !path) {  // {error, busy}: refused (busy: asking again later may work)
      const refused = new Error(path && path.error ? path.error : `Layer ${layer} was refused.`);
      refused.busy = !path || path.busy !== false;
      throw refused;
    }
    const buffer = await fetchBuffer(fileUrl(path));
    return { layer: parseLayer(m, buffer, head)[0], sharedMax: new Float32Array(buffer.slice(0, head)) };
  }

  // layer `layer` of the analysis shown, whole or (the first view of one that came early) with the
  // row of `query` in it
  async function ensureLayer(layer, query) {
    const m = meta;
    let got = layers[layer - 1];
    if (!got || got instanceof Promise) {
      if (meta) release(meta.id);
      if (!got) {
        got = layers[layer - 1] = fetchLayer(m, layer).then((fetched) => {
          if (meta === m && !sharedMax) sharedMax = fetched.sharedMax;
          return fetched.layer;
        });
      }
      const pending = got;
      try {
        got = await pending;
        if (meta === m && layers[layer - 1] === pending) layers[layer - 1] = got;
      } catch (error) {
        if (meta === m && layers[layer - 1] === pending) layers[layer - 1] = null;  // not kept: asked for again when it is next shown
        throw error;
      }
    }
    if (got.only === undefined || got.only === query) return got;
    release(m.id);  // another query of a first view: the whole layer now
    if (!got.full) got.full = stackBlock(m, layer);
    const full = got.full;
    try {
      const whole = await full;
      if (meta === m && layers[layer - 1] === got) layers[layer - 1] = whole;
      return whole;
    } catch (error) {
      if (got.full === full) got.full = null;  // asked for again when it is next shown
      throw error;
    }
  }

  // an analysis' explorer: its pictures and the layer shown first (the last) fetched while the
  // explorer still shows the one before, then all of it shown at once; `early` gives the pictures
  // (being fetched already) and the first view's data
  async function load(value, given = {}) {
    const ticket = ++loading;
    loadingId = value ? value.id : null;
    root.dataset.analysis = "";
    root.dataset.complete = "";
    if (!value || value.mode === "server") {
      meta = value;
      layers = [];
      sharedMax = null;
      root.classList.toggle("vvx-off", true);
      statusText.textContent = value ? value.note : "Analyse an image first.";
      return;
    }
    const next = { meta: value, layers: [], sharedMax: null, complete: false };
    if (value.mode === "stack") fetchStack(next, given.first);
    const first = value.mode === "stack" ? next.layers[value.depth - 1]
      : fetchLayer(value, value.depth).then((got) => { next.sharedMax = got.sharedMax; return got.layer; });
    const drawn = given.pictures || pictures(value);
    let b, t, shownFirst;
    try {
      [[b, t], shownFirst] = await Promise.all([drawn, first]);
    } catch (error) {
      if (ticket !== loading) return;
      loadingId = null;  // the same analysis' value, when it comes again, is loaded again
      const tries = given.tries || 0;
      const why = error.busy === false ? error.message  // (refused for good: the analysis no longer kept, ...)
        : "The explorer's data could not be fetched now (the server is busy or the analysis expired); analyse the image again.";
      if (given.first) {  // an early value: the page's other results are still the analysis' before, and so is the explorer
        statusText.textContent = why;
        return;
      }
      // the page's results are this analysis': the one before is not shown beside them; tried again shortly
      [meta, layers, sharedMax, base, tileBase] = [null, [], null, null, null];
      root.classList.toggle("vvx-off", true);
      if (tries >= RETRIES || error.busy === false) {
        statusText.textContent = why;
        return;
      }
      statusText.textContent = "The explorer's data could not be fetched yet: trying again…";
      setTimeout(() => { if (ticket === loading) load(value, { tries: tries + 1 }); }, 1000 * 2 ** tries);
      return;
    }
    if (ticket !== loading) return;
    // (a whole last layer that came before this first view is kept)
    if (value.mode !== "stack" || next.layers[value.depth - 1] === first) next.layers[value.depth - 1] = shownFirst;
    [meta, layers, sharedMax, base, tileBase] = [value, next.layers, next.sharedMax, b, t];
    pixelPatch = patchIndex(base.width, base.height, meta.grid);
    tilePatch = patchIndex(tileBase.width, tileBase.height, meta.grid);
    root.classList.toggle("vvx-off", false);
    statusText.textContent = "";
    setupControls();
    Object.assign(view, { layer: meta.depth, head: meta.heads, query: 0, pinned: false });
    layerInput.value = view.layer;
    headSelect.value = String(view.head);
    await draw();
    if (ticket === loading) {
      // data-source: "early" when it came before the analysis' outputs (`early`), else "outputs"
      Object.assign(root.dataset, { analysis: meta.id, grid: meta.grid.join("x"), prefix: String(meta.prefix.length),
        source: given.first ? "early" : "outputs" });
      if (next.complete) root.dataset.complete = meta.id;
    }
  }

  // the page names each analysis it asks for (page.NAME_ANALYSIS) and asks for its explorer at once:
  // it comes as soon as the forward has written it, before the analysis' other outputs; None: it
  // comes with them (`vitviz.server.early`)
  function newTicket() {
    const bytes = crypto.getRandomValues(new Uint8Array(16));
    return btoa(String.fromCharCode(...bytes)).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  }

  async function early(ticket, mine) {
    try {  // nothing early (None, or an error): the analysis' outputs bring the explorer
      const paths = await server.explorer_early(ticket, "pictures");  // written before the forward
      if (!paths || mine !== named) return;
      const drawn = pictures(paths);
      drawn.catch(() => {});
      const value = await server.explorer_early(ticket, "explorer");  // once the forward has written the file
      if (!value || mine !== named || value.id === loadingId || (meta && value.id === meta.id)) return;
      const { first, ...rest } = value;
      load(rest, { pictures: drawn, first });
    } catch (error) {}
  }

  window.vitvizTicket = () => {
    const ticket = newTicket(), mine = ++named;
    early(ticket, mine);
    return ticket;
  };

  function setupControls() {
    layerInput.max = meta.depth;
    headSelect.innerHTML = "";
    const names = [...Array(meta.heads).keys()].map((h) => `head ${h + 1}`).concat(["mean", "max"]);
    names.forEach((name, i) => {
      const o = document.createElement("option");
      o.value = String(i);
      o.textContent = name;
      headSelect.appendChild(o);
    });
    prefixBox.innerHTML = "";
    meta.prefix.forEach((name, i) => {
      const b = document.createElement("button");
      b.type = "button";
      b.textContent = name;
      b.className = "vvx-token";
      b.addEventListener("click", () => { Object.assign(view, { query: i, pinned: true }); draw(); });
      prefixBox.appendChild(b);
    });
  }

  function values(layer, head, query) {
    const L = layers[layer - 1];
    const n = meta.tokens, m = meta.patches;
    const row = head * n + query;
    const top = L.top[row];
    const out = new Float64Array(m);
    const start = row * m;
    for (let j = 0; j < m; j++) out[j] = L.q[start + j] * top / 255;
    return out;
  }

  // the colour scale of a view: "layer" one scale for the layer's maps (every head, mean and max) so
  // that the map and the mosaic share a colour bar; "shared" 0 to the query's largest weight in any
  // layer and head; "map" each map its own min..max
  function range(v, want) {
    if (want.scale === "shared") return [0, sharedMax[want.query]];
    if (want.scale === "map") return ownRange(v);
    let lo = Infinity, hi = -Infinity;
    for (let h = 0; h < meta.views; h++) {
      const [a, b] = ownRange(values(want.layer, h, want.query));
      lo = Math.min(lo, a); hi = Math.max(hi, b);
    }
    return [lo, hi];
  }

  function blend(target, baseData, patchOf, idx) { blendCells(target, baseData, patchOf, idx, meta.lut); }

  function outline(img, query) {
    // the query patch framed as PIL's rectangle(outline, width) frames it: inside the patch's box
    const p = meta.prefix.length;
    if (query < p) return;
    const px = meta.patch_px;
    const r = Math.floor((query - p) / meta.grid[1]), c = (query - p) % meta.grid[1];
    frameCell(img, c * px, r * px, px, Math.max(1, Math.floor(px / 8)));
  }

  function outlineWindow(img, query, layer) {
    // a block that attends within windows of the grid (Qwen2.5-VL's tower): the query's window framed, 1 px
    const side = (meta.windows || [])[layer - 1] || 0, p = meta.prefix.length;
    if (!side || query < p) return;
    const px = meta.patch_px, d = img.data, width = img.width;
    const r = Math.floor((query - p) / meta.grid[1]), c = (query - p) % meta.grid[1];
    const r0 = Math.floor(r / side) * side, c0 = Math.floor(c / side) * side;
    const x0 = c0 * px, y0 = r0 * px;
    const x1 = Math.min(c0 + side, meta.grid[1]) * px - 1, y1 = Math.min(r0 + side, meta.grid[0]) * px - 1;
    const paint = (x, y) => { const k = 4 * (y * width + x); d[k] = 255; d[k + 1] = 255; d[k + 2] = 255; };
    for (let x = x0; x <= x1; x++) { paint(x, y0); paint(x, y1); }
    for (let y = y0; y <= y1; y++) { paint(x0, y); paint(x1, y); }
  }

  function drawBar(lo, hi) { paintBar(barCanvas, ticks, meta.lut, lo, hi); }

  let drawing = 0;          // the newest draw: one that waited for its layer is not drawn over a newer one
  // the view asked for; a layer refused (the server busy) is asked for again after 1, 2 and 4 s while
  // the view stays on it
  async function draw(tries = 0) {
    if (!meta || meta.mode === "server" || !base) return;
    const want = { ...view }, m = meta, mine = ++drawing;
    if (m.mode === "layers" && !layers[want.layer - 1]) {  // a layer's own file: only for a layer the view stays on
      await new Promise((resolve) => setTimeout(resolve, SETTLE_MS));  // (a dragged slider passes several)
      if (meta !== m || mine !== drawing) return;
    }
    try {
      await ensureLayer(want.layer, want.query);
    } catch (error) {
      if (meta !== m || mine !== drawing) return;  // another view asked for meanwhile: its own draw fetches it
      if (tries >= RETRIES || error.busy === false) {  // (refused for good: the analysis no longer kept, ...)
        statusText.textContent = error.busy === false ? error.message
          : `Layer ${want.layer} could not be fetched now (the server is busy or the analysis expired); show it again to retry.`;
        return;
      }
      statusText.textContent = `Layer ${want.layer} could not be fetched yet: trying again…`;
      setTimeout(() => { if (meta === m && mine === drawing) draw(tries + 1); }, 1000 * 2 ** tries);
      return;
    }
    if (meta !== m || mine !== drawing) return;  // another analysis or another view asked for meanwhile: drawn by its own draw
    statusText.textContent = "";
    if (meta.mode === "layers" && !sharedMax) return;
    const v = values(want.layer, want.head, want.query);
    const [lo, hi] = range(v, want);
    const img = new ImageData(base.width, base.height);
    blend(img, base, pixelPatch, indices(v, lo, hi));
    outline(img, want.query);
    outlineWindow(img, want.query, want.layer);
    mapCanvas.width = base.width;
    mapCanvas.height = base.height;
    mapCanvas.getContext("2d").putImageData(img, 0, 0);
    drawBar(lo, hi);
    drawMosaic(want, want.scale === "map" ? null : [lo, hi]);
    const headName = want.head < meta.heads ? `head ${want.head + 1}` : ["mean", "max"][want.head - meta.heads];
    Object.assign(mapCanvas.dataset, { layer: String(want.layer), head: headName, query: String(want.query), scale: want.scale });
    layerOut.textContent = String(want.layer);
    const p = meta.prefix.length;
    queryText.textContent = want.query < p ? `query: the ${meta.prefix[want.query]} token${want.pinned ? " (pinned)" : ""}`
      : `query: patch row ${Math.floor((want.query - p) / meta.grid[1]) + 1}, column ${(want.query - p) % meta.grid[1] + 1}${want.pinned ? " (pinned)" : ""}`;
  }

  function drawMosaic(want, common) {
    // every head of the layer: on the map's colour bar, or (each map its own) its range beneath it
    const t = tileBase.width, th = tileBase.height, gap = 6, strip = 16, heads = meta.heads;
    const cols = Math.ceil(Math.sqrt(heads)), rows = Math.ceil(heads / cols);
    const ctx = labelledCanvas(mosaicCanvas, cols * t + (cols - 1) * gap, rows * (th + strip) + (rows - 1) * gap);
    for (let h = 0; h < heads; h++) {
      const v = values(want.layer, h, want.query);
      const [lo, hi] = common || ownRange(v);
      const img = new ImageData(t, th);
      blend(img, tileBase, tilePatch, indices(v, lo, hi));
      const x = (h % cols) * (t + gap), y = Math.floor(h / cols) * (th + strip + gap);
      ctx.putImageData(img, x, y);
      ctx.fillStyle = "#1e1e1e";
      ctx.fillText(common ? `head ${h + 1}` : `head ${h + 1}: ${fmt(lo)}–${fmt(hi)}`, x + t / 2, y + th + strip / 2);
    }
    mosaicCanvas.dataset.layer = String(want.layer);
    mosaicCanvas.dataset.query = String(want.query);
    mosaicCanvas.dataset.scale = want.scale;
    mosaicNote.textContent = `Every head of layer ${want.layer} for the same query; ` +
      (common ? "colours on the map's bar." : "each head on its own scale, its range beneath it.");
  }

  // hover, click and keys on the map (`wireMap`): the patches follow the prefix tokens
  wireMap(mapCanvas, view, { ready: () => Boolean(meta), first: () => meta.prefix.length, grid: () => meta.grid,
                             patchPx: () => meta.patch_px, draw });
  layerInput.addEventListener("input", () => { view.layer = Number(layerInput.value); draw(); });
  headSelect.addEventListener("change", () => { view.head = Number(headSelect.value); draw(); });
  scaleSelect.addEventListener("change", () => { view.scale = scaleSelect.value; draw(); });

  // the same analysis again (its explorer came early, then with the analysis' outputs, then from the step after it): kept as it is
  watch("value", () => {
    const v = props.value;
    if (v) release(v.id);  // the analysis' outputs are here: its other layers may come now
    if (v && (v.id === loadingId || (meta && v.id === meta.id && v.mode === meta.mode))) return;
    load(v);
  });
  load(props.value);
})();
