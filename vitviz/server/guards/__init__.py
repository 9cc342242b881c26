"""What keeps a public server within its bounds: the checks of every value a client sends (`inputs`),
Gradio's edges made safe (`gradio_io`: uploads, files out, sessions, callers, the queue's turns), the
middlewares in front of Gradio (`asgi`: upload and body limits, known events, session hashes), the
model work's budget and lanes (`work`), the sessions' analyses (`sessions`), the settings from the
environment (`settings`), memory given back (`memory`) and the downloads and sweeps of the folders
it writes (`export`)."""
