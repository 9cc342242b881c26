// What a reader would call broken on the page as laid out now, by element boxes: evaluated in the
// page (Playwright's page.evaluate), it returns {empty, overlaps, clipped, small}:
//   empty    a figure on screen with no picture, or one that failed to load (each shows a picture or is not there);
//   overlaps two texts whose boxes cross, or a text over a picture;
//   clipped  a text cut by a box that hides what leaves it (overflow hidden or clip);
//   small    a text under 10 px high.
// Only what is displayed counts (an unselected tab's panel, a closed menu, a hidden column: not).
() => {
  const shown = (el) => {
    for (let e = el; e && e !== document.body; e = e.parentElement) {
      const s = getComputedStyle(e);
      if (s.display === 'none' || s.visibility === 'hidden' || s.opacity === '0') return false;
    }
    const r = el.getBoundingClientRect();
    return r.width > 0 && r.height > 0;
  };
  const name = (el) => {
    const f = el.closest('[id]');
    return (f ? '#' + f.id : el.tagName.toLowerCase());
  };
  const cross = (a, b, slack) => a.left + slack < b.right && b.left + slack < a.right && a.top + slack < b.bottom && b.top + slack < a.bottom;
  const busy = (el) => el.closest('.pending, .generating, [data-testid=status-tracker]') !== null;

  const empty = [];
  for (const f of document.querySelectorAll('.vv-figure')) {
    if (!shown(f) || busy(f)) continue;
    const img = f.querySelector('img');  // none, none to fetch, or one that failed (a lazy one below the fold is waiting, not empty)
    if (!img || !img.getAttribute('src') || (img.complete && img.naturalWidth === 0)) empty.push(name(f));
  }

  const texts = [];
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  while (walker.nextNode()) {
    const node = walker.currentNode, text = node.textContent.trim();
    const el = node.parentElement;
    if (!text || !el || ['SCRIPT', 'STYLE', 'NOSCRIPT', 'TITLE', 'OPTION'].includes(el.tagName) || !shown(el) || busy(el)) continue;
    if (el.closest('.sr-only, [aria-hidden=true]')) continue;
    const range = document.createRange();
    range.selectNodeContents(node);
    for (const r of range.getClientRects()) {
      if (r.width < 1 || r.height < 1) continue;
      texts.push({ text: text.slice(0, 50), r, el });
    }
  }

  const overlaps = [];
  for (let i = 0; i < texts.length; i++) {
    for (let j = i + 1; j < texts.length; j++) {
      const a = texts[i], b = texts[j];
      if (a.el === b.el || a.el.contains(b.el) || b.el.contains(a.el)) continue;
      if (cross(a.r, b.r, 2)) overlaps.push(`"${a.text}" (${name(a.el)}) / "${b.text}" (${name(b.el)})`);
    }
  }
  // pictures, and the icons of buttons (a download button over a label's end hides it as a picture would)
  const pictures = [...document.querySelectorAll('img, canvas, button svg, a svg')].filter((p) => shown(p) && !busy(p));
  for (const t of texts) {
    for (const p of pictures) {
      if (p.contains(t.el) || t.el.closest('.vv-colourbar')) continue;
      if (cross(t.r, p.getBoundingClientRect(), 2)) overlaps.push(`"${t.text}" (${name(t.el)}) over a picture (${name(p)})`);
    }
  }

  // a component's label is a box with a background: it must not lie over a picture either
  for (const label of document.querySelectorAll('[data-testid=block-label]')) {
    if (!shown(label) || busy(label)) continue;
    for (const p of pictures) {
      if (label.contains(p)) continue;
      if (cross(label.getBoundingClientRect(), p.getBoundingClientRect(), 1)) overlaps.push(`the label "${label.innerText.trim().slice(0, 50)}" over a picture (${name(p)})`);
    }
  }

  const clipped = [];
  for (const t of texts) {
    for (let e = t.el; e && e !== document.body; e = e.parentElement) {
      const s = getComputedStyle(e);
      if (!['hidden', 'clip'].includes(s.overflowX) && !['hidden', 'clip'].includes(s.overflowY)) continue;
      const box = e.getBoundingClientRect();
      const out = (['hidden', 'clip'].includes(s.overflowX) && (t.r.left < box.left - 1 || t.r.right > box.right + 1)) ||
                  (['hidden', 'clip'].includes(s.overflowY) && (t.r.top < box.top - 1 || t.r.bottom > box.bottom + 1));
      if (out) { clipped.push(`"${t.text}" (${name(t.el)}) cut by ${name(e)} ${e.tagName.toLowerCase()}.${[...e.classList].join('.')}`); break; }
    }
  }

  const small = texts.filter((t) => parseFloat(getComputedStyle(t.el).fontSize) < 10).map((t) => `"${t.text}" (${name(t.el)})`);
  return { empty, overlaps: [...new Set(overlaps)], clipped: [...new Set(clipped)], small: [...new Set(small)] };
}
