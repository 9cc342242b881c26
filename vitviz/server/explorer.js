// vitviz's attention explorer, drawn in the browser (gr.HTML's js_on_load: `element`, `props`,
// `watch` and `server` are Gradio's). Every view is computed here from the 8-bit rows the server
// writes once per analysis (vitviz/server/explorer_data.py; the layer shown first is fetched
// before the others), by the same rule as the server's own
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

  let meta = null;          // the analysis' layout (props.value)
  let layers = [];          // per layer: {top: Float32Array [V*N], q: Uint8Array [V*N*M]} or a Promise
  let sharedMax = null;     // Float32Array [N]
  let base = null;          // ImageData of the display image
  let tileBase = null;      // ImageData of a mosaic tile's image
  let pixelPatch = null;    // Int32Array: the patch of each display pixel
  let tilePatch = null;     // Int32Array: the patch of each tile pixel
  const view = { layer: 1, head: 0, query: 0, pinned: false, scale: scaleSelect.value };
  let loading = 0;

  const fileUrl = (path) => new URL("gradio_api/file=" + path, document.baseURI).href;

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

  function patchIndex(side, grid) {
    const per = side / grid[1];
    const out = new Int32Array(side * side);
    for (let y = 0; y < side; y++) {
      const r = Math.floor(y / per) * grid[1];
      for (let x = 0; x < side; x++) out[y * side + x] = r + Math.floor(x / per);
    }
    return out;
  }

  function parseLayer(buffer, offset) {
    const v = meta.views, n = meta.tokens, m = meta.patches;
    const top = new Float32Array(buffer.slice(offset, offset + 4 * v * n));
    const q = new Uint8Array(buffer, offset + 4 * v * n, v * n * m);
    return [{ top, q }, offset + 4 * v * n + v * n * m];
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

  // the "stack" file: the shared maxima and the layer shown first (the last) fetched first, then the
  // other layers in one request; a layer asked for meanwhile waits for them
  function fetchStack(url, ticket) {
    const head = 4 * meta.tokens, block = meta.views * meta.tokens * (4 + meta.patches), last = meta.depth - 1;
    const top = fetchRange(url, 0, head).then((buffer) => { if (ticket === loading) sharedMax = new Float32Array(buffer); });
    layers[last] = Promise.all([top, fetchRange(url, head + last * block, head + meta.depth * block)])
      .then(([, buffer]) => parseLayer(buffer, 0)[0]);
    if (last > 0) {
      const rest = layers[last].then(() => fetchRange(url, head, head + last * block)).then((buffer) => {
        const parsed = [];
        for (let l = 0, offset = 0; l < last; l++) [parsed[l], offset] = parseLayer(buffer, offset);
        return parsed;
      });
      for (let l = 0; l < last; l++) layers[l] = rest.then((parsed) => parsed[l]);
    }
    layers.forEach((p) => p.catch(() => {}));  // a failure is reported when its layer is drawn
    const id = meta.id;  // data-complete: every layer is in (what a benchmark waits for before timing anything else)
    Promise.all(layers).then(() => { if (ticket === loading) root.dataset.complete = id; }, () => {});
  }

  async function ensureLayer(layer) {
    if (layers[layer - 1] && !(layers[layer - 1] instanceof Promise)) return layers[layer - 1];
    if (!layers[layer - 1]) {
      layers[layer - 1] = (async () => {
        if (meta.mode === "stack") {  // fetched again by itself: its block of the file
          const head = 4 * meta.tokens, block = meta.views * meta.tokens * (4 + meta.patches);
          if (!sharedMax) sharedMax = new Float32Array(await fetchRange(fileUrl(meta.data), 0, head));
          return parseLayer(await fetchRange(fileUrl(meta.data), head + (layer - 1) * block, head + layer * block), 0)[0];
        }
        const path = await server.explorer_layer(meta.id, layer);
        const buffer = await fetchBuffer(fileUrl(path));
        sharedMax = new Float32Array(buffer.slice(0, 4 * meta.tokens));
        return parseLayer(buffer, 4 * meta.tokens)[0];
      })();
    }
    const pending = layers[layer - 1];
    try {
      const got = await pending;
      if (layers[layer - 1] === pending) layers[layer - 1] = got;
      return got;
    } catch (error) {
      if (layers[layer - 1] === pending) layers[layer - 1] = null;  // not kept: asked for again when it is next shown
      throw error;
    }
  }

  async function load(value) {
    const ticket = ++loading;
    meta = value;
    layers = [];
    sharedMax = null;
    root.dataset.analysis = "";
    root.dataset.complete = "";
    if (!meta || meta.mode === "server") {
      root.classList.toggle("vvx-off", true);
      statusText.textContent = meta ? meta.note : "Analyse an image first.";
      return;
    }
    root.classList.toggle("vvx-off", false);
    statusText.textContent = "";
    if (meta.mode === "stack") fetchStack(fileUrl(meta.data), ticket);  // beside the pictures
    const [b, t] = await Promise.all([imageData(fileUrl(meta.base)), imageData(fileUrl(meta.tile_base))]);
    if (ticket !== loading) return;
    base = b;
    tileBase = t;
    pixelPatch = patchIndex(base.width, meta.grid);
    tilePatch = patchIndex(tileBase.width, meta.grid);
    setupControls();
    Object.assign(view, { layer: meta.depth, head: meta.heads, query: 0, pinned: false });
    layerInput.value = view.layer;
    headSelect.value = String(view.head);
    await draw();
    if (ticket === loading) { root.dataset.analysis = meta.id; root.dataset.grid = meta.grid.join("x"); root.dataset.prefix = String(meta.prefix.length); }
  }

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

  function ownRange(v) {
    let lo = Infinity, hi = -Infinity;
    for (let j = 0; j < v.length; j++) { if (v[j] < lo) lo = v[j]; if (v[j] > hi) hi = v[j]; }
    return [lo, hi];
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

  function indices(v, lo, hi) {
    const out = new Uint8Array(v.length);
    if (!(hi > lo)) return out;
    for (let j = 0; j < v.length; j++) out[j] = Math.min(255, Math.max(0, Math.floor((v[j] - lo) / (hi - lo) * 255 + 0.5)));
    return out;
  }

  function blend(target, baseData, patchOf, idx) {
    const lut = meta.lut, src = baseData.data, dst = target.data;
    for (let p = 0, k = 0; p < patchOf.length; p++, k += 4) {
      const c = 3 * idx[patchOf[p]];
      dst[k] = Math.floor((2 * src[k] + 3 * lut[c] + 2) / 5);
      dst[k + 1] = Math.floor((2 * src[k + 1] + 3 * lut[c + 1] + 2) / 5);
      dst[k + 2] = Math.floor((2 * src[k + 2] + 3 * lut[c + 2] + 2) / 5);
      dst[k + 3] = 255;
    }
  }

  function outline(img, query) {
    // the query patch framed as PIL's rectangle(outline, width) frames it: inside the patch's box
    const p = meta.prefix.length;
    if (query < p) return;
    const px = meta.patch_px, w = Math.max(1, Math.floor(px / 8)), side = img.width, d = img.data;
    const r = Math.floor((query - p) / meta.grid[1]), c = (query - p) % meta.grid[1];
    const x0 = c * px, y0 = r * px;
    for (let y = y0; y < y0 + px; y++) {
      for (let x = x0; x < x0 + px; x++) {
        if (x - x0 >= w && x0 + px - 1 - x >= w && y - y0 >= w && y0 + px - 1 - y >= w) continue;
        const k = 4 * (y * side + x);
        d[k] = 0; d[k + 1] = 229; d[k + 2] = 255;
      }
    }
  }

  function fmt(v) {
    if (v === 0) return "0";
    if (Math.abs(v) < 1e-3) return v.toExponential(1).replace(/e([+-])(\d)$/, "e$10$2");
    return String(parseFloat(v.toPrecision(3)));
  }

  function drawBar(lo, hi) {
    const ctx = barCanvas.getContext("2d");
    const h = barCanvas.height;
    for (let y = 0; y < h; y++) {
      const i = 3 * Math.round(255 * (1 - y / (h - 1)));
      ctx.fillStyle = `rgb(${meta.lut[i]},${meta.lut[i + 1]},${meta.lut[i + 2]})`;
      ctx.fillRect(0, y, barCanvas.width, 1);
    }
    ticks.innerHTML = [4, 3, 2, 1, 0].map((i) => `<span>${fmt(lo + (hi - lo) * i / 4)}</span>`).join("");
  }

  async function draw() {
    if (!meta || meta.mode === "server" || !base) return;
    const want = { ...view };
    try {
      await ensureLayer(want.layer);
    } catch (error) {
      statusText.textContent = `Layer ${want.layer} could not be fetched now (the server is busy or the analysis expired); show it again to retry.`;
      return;
    }
    statusText.textContent = "";
    if (meta.mode === "layers" && !sharedMax) return;
    const v = values(want.layer, want.head, want.query);
    const [lo, hi] = range(v, want);
    const img = new ImageData(base.width, base.height);
    blend(img, base, pixelPatch, indices(v, lo, hi));
    outline(img, want.query);
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
    const t = tileBase.width, gap = 6, strip = 16, heads = meta.heads;
    const cols = Math.ceil(Math.sqrt(heads)), rows = Math.ceil(heads / cols);
    mosaicCanvas.width = cols * t + (cols - 1) * gap;
    mosaicCanvas.height = rows * (t + strip) + (rows - 1) * gap;
    const ctx = mosaicCanvas.getContext("2d");
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, mosaicCanvas.width, mosaicCanvas.height);
    ctx.font = "12px sans-serif";
    ctx.textAlign = "center";
    ctx.textBaseline = "middle";
    for (let h = 0; h < heads; h++) {
      const v = values(want.layer, h, want.query);
      const [lo, hi] = common || ownRange(v);
      const img = new ImageData(t, t);
      blend(img, tileBase, tilePatch, indices(v, lo, hi));
      const x = (h % cols) * (t + gap), y = Math.floor(h / cols) * (t + strip + gap);
      ctx.putImageData(img, x, y);
      ctx.fillStyle = "#1e1e1e";
      ctx.fillText(common ? `head ${h + 1}` : `head ${h + 1}: ${fmt(lo)}–${fmt(hi)}`, x + t / 2, y + t + strip / 2);
    }
    mosaicCanvas.dataset.layer = String(want.layer);
    mosaicCanvas.dataset.query = String(want.query);
    mosaicCanvas.dataset.scale = want.scale;
    mosaicNote.textContent = `Every head of layer ${want.layer} for the same query; ` +
      (common ? "colours on the map's bar." : "each head on its own scale, its range beneath it.");
  }

  function patchUnder(event) {
    const rect = mapCanvas.getBoundingClientRect();
    const x = (event.clientX - rect.left) / rect.width * mapCanvas.width;
    const y = (event.clientY - rect.top) / rect.height * mapCanvas.height;
    const px = meta.patch_px;
    const r = Math.min(meta.grid[0] - 1, Math.max(0, Math.floor(y / px)));
    const c = Math.min(meta.grid[1] - 1, Math.max(0, Math.floor(x / px)));
    return meta.prefix.length + r * meta.grid[1] + c;
  }

  mapCanvas.addEventListener("mousemove", (event) => {
    if (!meta || view.pinned) return;
    const q = patchUnder(event);
    if (q !== view.query) { view.query = q; draw(); }
  });
  mapCanvas.addEventListener("click", (event) => {
    if (!meta) return;
    const q = patchUnder(event);
    if (view.pinned && q === view.query) { view.pinned = false; } else { Object.assign(view, { query: q, pinned: true }); }
    draw();
  });
  // by keyboard: the map takes focus (Tab); arrows move the query patch, Enter pins it, Escape lets go
  const STEPS = { ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0] };
  mapCanvas.addEventListener("keydown", (event) => {
    if (!meta) return;
    const p = meta.prefix.length;
    if (event.key in STEPS) {
      const [dr, dc] = STEPS[event.key];
      const at = Math.max(0, view.query - p);  // a prefix token as the query: start from the first patch
      const r = Math.min(meta.grid[0] - 1, Math.max(0, Math.floor(at / meta.grid[1]) + (view.query < p ? 0 : dr)));
      const c = Math.min(meta.grid[1] - 1, Math.max(0, (at % meta.grid[1]) + (view.query < p ? 0 : dc)));
      view.query = p + r * meta.grid[1] + c;
    } else if (event.key === "Enter" || event.key === " ") {
      view.pinned = !view.pinned;
    } else if (event.key === "Escape") {
      view.pinned = false;
    } else {
      return;
    }
    event.preventDefault();
    draw();
  });
  layerInput.addEventListener("input", () => { view.layer = Number(layerInput.value); draw(); });
  headSelect.addEventListener("change", () => { view.head = Number(headSelect.value); draw(); });
  scaleSelect.addEventListener("change", () => { view.scale = scaleSelect.value; draw(); });

  // the same analysis again (its explorer came with the analysis, then from the step after it): kept as it is
  watch("value", () => { const v = props.value; if (!(v && meta && v.id === meta.id && v.mode === meta.mode)) load(v); });
  load(props.value);
})();
