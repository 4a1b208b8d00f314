"""Scale-out on Ray Serve, on one machine: two SmolLM2 replicas behind one OpenAI endpoint on loopback, used
through the official client; both replicas serve, answers equal one process's, and when a replica dies mid-request
its client gets an error while the endpoint keeps serving with the other."""

from __future__ import annotations

import socket

import httpx
import pytest
from openai import OpenAI

from specdecode.api import SpecDecoder
from specdecode.config import SamplingParams
from specdecode.server.settings import ServerSettings

ray = pytest.importorskip("ray", reason="Ray Serve is optional: pip install 'specdecode[ray]'")
ray_app = pytest.importorskip("specdecode.server.ray_app")

SMOL = "smollm2-135m-instruct"
LOAD = dict(target=SMOL, method="ngram", dtype="float32", max_len=512)

pytestmark = pytest.mark.e2e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url():
    base = ray_app.start(LOAD, ServerSettings(model_name=SMOL), replicas=2, host="127.0.0.1", port=free_port(),
                         cpus=1)
    yield base
    ray_app.stop()


def test_two_replicas_serve_one_endpoint_with_the_same_answers(url):
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    prompt = "The three primary colors are"
    expected = SpecDecoder.load(**LOAD).generate(prompt, SamplingParams(max_new_tokens=12)).text
    replicas = set()
    for _ in range(6):
        raw = client.completions.with_raw_response.create(model=SMOL, prompt=prompt, max_tokens=12, temperature=0)
        replicas.add(raw.headers["x-specdecode-replica"])
        assert raw.parse().choices[0].text == expected
    chat = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                          temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    health = {httpx.get(url + "/health").json()["replica"] for _ in range(10)}
    assert len(replicas | health) == 2  # both replicas answered


def test_a_replica_dying_mid_request_fails_its_client_only(url):
    body = {"model": SMOL, "prompt": "Count: one, two,", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            victim = stream.headers["x-specdecode-replica"]
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # generating
            kill_replica(victim)
            with pytest.raises(httpx.HTTPError):
                for line in lines:
                    assert line != "data: [DONE]", "the stream of a killed replica cannot finish"
        for _ in range(4):  # the endpoint keeps serving with the other replica (and Ray starts a new one)
            done = http.post("/v1/completions", json={"model": SMOL, "prompt": "Hello", "max_tokens": 4})
            assert done.status_code == 200, done.text


def kill_replica(tag: str) -> None:
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(tag)]
    assert names, f"no actor for replica {tag}"
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)


