// The Video tab's explorer, drawn in the browser (gr.HTML's js_on_load: `element`, `props` and `watch`
// are Gradio's). Everything comes with the run's outputs (`video_explorer.payload`): the frames as the
// model saw them and, per layer, every patch query's head-averaged attention over the patches in 8
// bits; the frame and layer sliders and the pointer redraw from them, with no call to the server. A
// row is read as value = q * rowmax / 255 (float64), and each frame of the strip shows its tubelet's
// map on the row's min..max by the server's own rule (`explorer_common.js`), so the browser draws what
// `video_explorer.strip_tiles` draws.
(() => {
  const root = element.querySelector(".vvv");
  const shownCanvas = root.querySelector(".vvv-shown");
  const stripCanvas = root.querySelector(".vvv-strip");
  const barCanvas = root.querySelector(".vvv-bar");
  const ticks = root.querySelector(".vvv-ticks");
  const frameInput = root.querySelector(".vvv-frame");
  const frameOut = root.querySelector(".vvv-frame-out");
  const layerInput = root.querySelector(".vvv-layer");
  const layerOut = root.querySelector(".vvv-layer-out");
  const queryText = root.querySelector(".vvv-query");
  const statusText = root.querySelector(".vvv-status");
  const GAP = 6, LABEL = 16;  // px between the strip's frames, and the strip of their labels beneath

  let meta = null;      // the clip's value (mode "browser")
  let top = null;       // Float32Array [L * Q]: each row's maximum
  let rows = null;      // Uint8Array [L * Q * Q]: the rows
  let shown = [];       // per frame, ImageData `scale` times as wide
  let tiles = [];       // per frame, ImageData at the model's size
  let tilePatch = null;  // Int32Array: the patch (y * w + x) of each pixel of a frame tile
  const view = { frame: 1, layer: 1, query: 0, pinned: false };  // query: the patch y * w + x of the shown frame

  const bytesOf = (text) => Uint8Array.from(atob(text), (c) => c.charCodeAt(0));

  // the patch under each pixel of a w x h picture of the frame's h x w grid
  function patchIndex(width, height, gh, gw) {
    const per = width / gw, out = new Int32Array(width * height);
    for (let y = 0; y < height; y++) {
      const r = Math.min(gh - 1, Math.floor(y / per)) * gw;
      for (let x = 0; x < width; x++) out[y * width + x] = r + Math.floor(x / per);
    }
    return out;
  }

  function off(text) {
    meta = null;
    root.classList.add("vvv-off");
    statusText.textContent = text;
    root.dataset.clip = "";
  }

  function load(value) {
    if (!value || value.mode !== "browser") return off(value ? value.note : "Run a clip first.");
    const [t, h, w] = value.grid, q = t * h * w, layers = value.depth;
    let data, pictures;
    try {
      data = bytesOf(value.data);
      if (data.length !== layers * q * (4 + q)) throw new Error("incomplete");
      pictures = value.pictures.map((p) => bytesOf(p).buffer);
      tiles = pictures.map((b) => rgbPicture(b, 1));
      shown = pictures.map((b) => rgbPicture(b, value.scale));
    } catch (error) {
      return off("The explorer's data is incomplete: run the clip again.");
    }
    top = new Float32Array(data.buffer.slice(0, 4 * layers * q));
    rows = new Uint8Array(data.buffer, 4 * layers * q, layers * q * q);
    meta = value;
    tilePatch = patchIndex(tiles[0].width, tiles[0].height, h, w);
    const first = value.first || { frame: 1, layer: layers, row: 1, col: 1 };
    Object.assign(view, { frame: first.frame, layer: first.layer, query: (first.row - 1) * w + first.col - 1, pinned: false });
    frameInput.max = String(value.frames);
    layerInput.max = String(layers);
    frameInput.value = String(view.frame);
    layerInput.value = String(view.layer);
    root.classList.remove("vvv-off");
    statusText.textContent = "";
    draw();
    root.dataset.clip = value.id;
  }

  // layer `layer`'s row of patch query `query` (token order over the clip's patches), float64 [Q]
  function values(layer, query) {
    const q = meta.grid[0] * meta.grid[1] * meta.grid[2], row = (layer - 1) * q + query, mx = top[row];
    const out = new Float64Array(q);
    for (let j = 0, start = row * q; j < q; j++) out[j] = rows[start + j] * mx / 255;
    return out;
  }

  function draw() {
    if (!meta) return;
    const [, h, w] = meta.grid, s = h * w, tubelet = Math.floor((view.frame - 1) / meta.tubelet);
    const v = values(view.layer, tubelet * s + view.query);
    const [lo, hi] = ownRange(v);
    const idx = indices(v, lo, hi);
    // the strip: each frame with its tubelet's map, one colour scale
    const side = tiles[0].width, count = meta.frames;
    const ctx = labelledCanvas(stripCanvas, count * side + (count - 1) * GAP, tiles[0].height + LABEL);
    for (let k = 0; k < count; k++) {
      const img = new ImageData(side, tiles[k].height), own = Math.floor(k / meta.tubelet);
      blendCells(img, tiles[k], tilePatch, idx.subarray(own * s, (own + 1) * s), meta.lut);
      const x = k * (side + GAP);
      ctx.putImageData(img, x, 0);
      const here = k === view.frame - 1;  // the shown frame's label, in bold
      ctx.font = here ? "bold 12px sans-serif" : "12px sans-serif";
      ctx.fillStyle = here ? "#0b6e99" : "#1e1e1e";
      ctx.fillText(`frame ${k + 1}`, x + side / 2, tiles[k].height + LABEL / 2);
    }
    paintBar(barCanvas, ticks, meta.lut, lo, hi);
    // the shown frame, the query patch framed
    const frame = shown[view.frame - 1], img = new ImageData(new Uint8ClampedArray(frame.data), frame.width, frame.height);
    const row = Math.floor(view.query / w), col = view.query % w;
    frameCell(img, col * meta.patch_px, row * meta.patch_px, meta.patch_px, meta.outline);
    shownCanvas.width = frame.width;
    shownCanvas.height = frame.height;
    shownCanvas.getContext("2d").putImageData(img, 0, 0);
    frameOut.textContent = String(view.frame);
    layerOut.textContent = String(view.layer);
    queryText.textContent = `Frame ${view.frame} (tubelet ${tubelet + 1}), row ${row + 1}, column ${col + 1}, layer ${view.layer}: ` +
      `its attention over every frame, heads averaged${view.pinned ? " (pinned: click it again to let go)" : ""}.`;
    Object.assign(shownCanvas.dataset, { frame: String(view.frame), layer: String(view.layer), row: String(row + 1),
                                         col: String(col + 1), pinned: String(view.pinned) });
    Object.assign(stripCanvas.dataset, { frame: String(view.frame), layer: String(view.layer), row: String(row + 1), col: String(col + 1) });
  }

  // hover, click and keys on the shown frame (`wireMap`): its patches, y * w + x
  wireMap(shownCanvas, view, { ready: () => Boolean(meta), first: () => 0, grid: () => meta.grid.slice(1),
                               patchPx: () => meta.patch_px, draw });
  frameInput.addEventListener("input", () => { view.frame = Number(frameInput.value); draw(); });
  layerInput.addEventListener("input", () => { view.layer = Number(layerInput.value); draw(); });

  watch("value", () => {
    const v = props.value;
    if (v && meta && v.id === meta.id) return;
    load(v);
  });
  load(props.value);
})();
