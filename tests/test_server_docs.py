"""The operator's pages: GET /docs is FastAPI's interactive API page and /openapi.json its document, both answered
without a key (the routes they describe still need one) and under the server's Host rules like everything else."""

from __future__ import annotations

import httpx
from server_thread import BackgroundServer
from test_server_scheduler import ScriptedDecoder

from specdecode.server.app import create_app
from specdecode.server.settings import ServerSettings


def test_docs_and_openapi_answer_without_a_key_while_the_api_still_needs_one():
    app = create_app(ScriptedDecoder(steps=3), ServerSettings(model_name="m", api_key="secret",
                                                              allowed_hosts=("127.0.0.1", "localhost")))
    with BackgroundServer(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        page = http.get("/docs")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "swagger-ui" in page.text and "/openapi.json" in page.text
        doc = http.get("/openapi.json")
        assert doc.status_code == 200
        schema = doc.json()
        assert "/v1/chat/completions" in schema["paths"] and "bearer" in schema["components"]["securitySchemes"]
        assert not {"/docs", "/openapi.json"} & set(schema["paths"])  # the pages are not API operations
        assert http.get("/v1/models").status_code == 401
        assert http.get("/docs", headers={"Host": "attacker.example"}).status_code == 400
