() => {
  // after an analysis: on a phone the page goes to the results; focus that was on the inputs (the
  // image, an example, Analyse) or nowhere goes to the status line that names what was analysed
  if (window.matchMedia('(max-width: 768px)').matches) document.getElementById('vv-results')?.scrollIntoView({block: 'start'});
  const status = document.getElementById('vv-status'), at = document.activeElement;
  if (status && (!at || at === document.body || at.closest('#vv-image, #vv-examples, #vv-run'))) {
    status.tabIndex = -1;
    status.focus({preventScroll: true});
  }
}
