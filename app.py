"""vitviz in the browser (the Gradio app)."""
