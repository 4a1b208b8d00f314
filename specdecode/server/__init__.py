"""OpenAI-compatible HTTP server over SpecDecoder: `specdecode serve`, or from Python:

    from specdecode import SpecDecoder
    from specdecode.server.app import create_app
    from specdecode.server.settings import ServerSettings
    app = create_app(SpecDecoder.load("smollm2-135m-instruct", method="ngram"),
                     ServerSettings(model_name="smollm2-135m-instruct"))

Modules: app (routes), service (request checks -> queued job), schemas (request bodies), openapi (the
/openapi.json document), scheduler (one worker thread runs the engine; fair admission, limits), streams
(SSE / whole answers), formats (OpenAI objects), metrics (Prometheus), cli (`serve` flags), ray_app (replicas on
Ray Serve), static/playground.html (GET /).
Nothing is imported here, so `specdecode generate` does not pay for importing the web stack.
"""
