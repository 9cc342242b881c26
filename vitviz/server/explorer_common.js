// What the page's explorers draw with: the global one (explorer.js), the windowed one
// (swin_explorer.js) and the Video tab's (video_explorer.js) are each loaded after this file
// (`explorer_data.widget_files`, `swin_explorer.widget_files`, `video_explorer.widget_files`). The
// colour rule is the server's own pictures' (`vitviz.plots.overlay` on 8-bit rows), so the browser and
// the server give the same pixels: index = floor((v - lo) / (hi - lo) * 255 + 1/2), pixel =
// floor((2 * image + 3 * colour + 2) / 5).

// a file of Gradio's upload folder, by its path
const fileUrl = (path) => new URL("gradio_api/file=" + path, document.baseURI).href;

// a picture of `explorer_data.rgb_file` (uint32 width, uint32 height, then RGB rows) as ImageData,
// each pixel drawn k x k times (nearest neighbour, as the server's `views.display_of`)
function rgbPicture(buffer, k = 1) {
  const head = new DataView(buffer, 0, Math.min(8, buffer.byteLength));
  const [w, h] = buffer.byteLength >= 8 ? [head.getUint32(0, true), head.getUint32(4, true)] : [0, 0];
  if (buffer.byteLength !== 8 + 3 * w * h) throw new Error("the explorer's picture is incomplete");
  const src = new Uint8Array(buffer, 8), W = w * k, out = new ImageData(W, h * k), d = out.data;
  for (let y = 0; y < h * k; y++) {
    const row = 3 * w * Math.floor(y / k);
    for (let x = 0, o = 4 * W * y; x < W; x++, o += 4) {
      const i = row + 3 * Math.floor(x / k);
      d[o] = src[i]; d[o + 1] = src[i + 1]; d[o + 2] = src[i + 2]; d[o + 3] = 255;
    }
  }
  return out;
}

// a map's own min..max
function ownRange(v) {
  let lo = Infinity, hi = -Infinity;
  for (let j = 0; j < v.length; j++) { if (v[j] < lo) lo = v[j]; if (v[j] > hi) hi = v[j]; }
  return [lo, hi];
}

// each value's index in the colour map, lo..hi over 0..255 (all 0 for a flat map)
function indices(v, lo, hi) {
  const out = new Uint8Array(v.length);
  if (!(hi > lo)) return out;
  for (let j = 0; j < v.length; j++) out[j] = Math.min(255, Math.max(0, Math.floor((v[j] - lo) / (hi - lo) * 255 + 0.5)));
  return out;
}

// the picture under the map blended with the colour of each pixel's cell: `cellOf[p]` the cell of
// pixel p, `idx[cell]` its colour index, `lut` the colour map as 256 RGB triples
function blendCells(target, baseData, cellOf, idx, lut) {
  const src = baseData.data, dst = target.data;
  for (let p = 0, k = 0; p < cellOf.length; p++, k += 4) {
    const c = 3 * idx[cellOf[p]];
    dst[k] = Math.floor((2 * src[k] + 3 * lut[c] + 2) / 5);
    dst[k + 1] = Math.floor((2 * src[k + 1] + 3 * lut[c + 1] + 2) / 5);
    dst[k + 2] = Math.floor((2 * src[k + 2] + 3 * lut[c + 2] + 2) / 5);
    dst[k + 3] = 255;
  }
}

// the square cell of `side` px at (x0, y0) framed in cyan, `width` px inside its box (as PIL's
// rectangle(outline="#00e5ff", width) frames it)
function frameCell(img, x0, y0, side, width) {
  const d = img.data;
  for (let y = y0; y < y0 + side; y++) {
    for (let x = x0; x < x0 + side; x++) {
      if (x - x0 >= width && x0 + side - 1 - x >= width && y - y0 >= width && y0 + side - 1 - y >= width) continue;
      const k = 4 * (y * img.width + x);
      d[k] = 0; d[k + 1] = 229; d[k + 2] = 255;
    }
  }
}

// a number as the colour bars write it (`vitviz.plots.tick_label`)
function fmt(v) {
  if (v === 0) return "0";
  if (Math.abs(v) < 1e-3) return v.toExponential(1).replace(/e([+-])(\d)$/, "e$10$2");
  return String(parseFloat(v.toPrecision(3)));
}

// `canvas` resized to width x height, cleared to white, its context set for centred 12 px labels
function labelledCanvas(canvas, width, height) {
  canvas.width = width;
  canvas.height = height;
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, width, height);
  ctx.font = "12px sans-serif";
  ctx.textAlign = "center";
  ctx.textBaseline = "middle";
  return ctx;
}

// the vertical colour bar from lo (bottom) to hi (top) on `canvas`, five values beside it in `ticks`
function paintBar(canvas, ticks, lut, lo, hi) {
  const ctx = canvas.getContext("2d");
  const h = canvas.height;
  for (let y = 0; y < h; y++) {
    const i = 3 * Math.round(255 * (1 - y / (h - 1)));
    ctx.fillStyle = `rgb(${lut[i]},${lut[i + 1]},${lut[i + 2]})`;
    ctx.fillRect(0, y, canvas.width, 1);
  }
  ticks.innerHTML = [4, 3, 2, 1, 0].map((i) => `<span>${fmt(lo + (hi - lo) * i / 4)}</span>`).join("");
}

// the map's pointer and keyboard: hovering shows the patch under the pointer, a click pins it (on the
// pinned one, lets go); with the map focused (Tab), arrows move the query `step()` patches, Enter
// pins it and Escape lets go. `first()` is the query index of the first patch (the queries before it
// are prefix or pooled tokens: an arrow from one starts at the first patch); nothing happens until
// `ready()`.
function wireMap(canvas, view, { ready, first, grid, patchPx, step = () => 1, draw }) {
  function under(event) {
    const rect = canvas.getBoundingClientRect();
    const x = (event.clientX - rect.left) / rect.width * canvas.width;
    const y = (event.clientY - rect.top) / rect.height * canvas.height;
    const [gh, gw] = grid(), px = patchPx();
    const r = Math.min(gh - 1, Math.max(0, Math.floor(y / px)));
    const c = Math.min(gw - 1, Math.max(0, Math.floor(x / px)));
    return first() + r * gw + c;
  }
  canvas.addEventListener("mousemove", (event) => {
    if (!ready() || view.pinned) return;
    const q = under(event);
    if (q !== view.query) { view.query = q; draw(); }
  });
  canvas.addEventListener("click", (event) => {
    if (!ready()) return;
    const q = under(event);
    if (view.pinned && q === view.query) { view.pinned = false; } else { Object.assign(view, { query: q, pinned: true }); }
    draw();
  });
  const STEPS = { ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0] };
  canvas.addEventListener("keydown", (event) => {
    if (!ready()) return;
    const p = first(), [gh, gw] = grid(), k = step();
    if (event.key in STEPS) {
      const [dr, dc] = STEPS[event.key];
      const at = Math.max(0, view.query - p), patch = view.query >= p;
      const r = Math.min(gh - 1, Math.max(0, Math.floor(at / gw) + (patch ? dr * k : 0)));
      const c = Math.min(gw - 1, Math.max(0, (at % gw) + (patch ? dc * k : 0)));
      view.query = p + r * gw + c;
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
}
