() => { if (window.matchMedia('(max-width: 768px)').matches)
    document.getElementById('vv-results')?.scrollIntoView({block: 'start'}); }
