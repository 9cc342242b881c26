"""The app's pictures of an analysis, no Gradio: the drawers of each token layout (`views` for global
attention, `swin_views` for windowed), the explorer's data for the browser (`explorer_data`,
`swin_explorer`) and the registry that picks a drawer by the analysis' layout (`drawers`)."""
