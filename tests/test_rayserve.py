"""casspec serve --ray (casspec/serve/rayserve.py): two engine replicas on a local Ray instance behind one ingress
answer the openai client as the single server does (completions and chat, blocking and streamed, the same text as
the engine alone, the same errors), a conversation returns to the replica that served it, and /metrics sums the
replicas'. Skipped where Ray Serve is not installed (casspec[ray])."""
from __future__ import annotations

import signal
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from casspec.runtime.engine import Engine  # noqa: E402
from casspec.runtime.target import EngineOptions  # noqa: E402
from casspec.serve.app import ServeConfig, bind  # noqa: E402
from casspec.serve.rayserve import affinity_key, application, summed  # noqa: E402
from tiny import tiny_gguf  # noqa: E402

OPTIONS = EngineOptions(autoprofile=False, keep_state=False)
CHAT = [{"role": "user", "content": "ab ba"}]


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """(base URL, the tiny GGUF's path): two replicas of it on a local Ray instance (one CPU each)."""
    import os

    path = str(tiny_gguf(tmp_path_factory.mktemp("ray") / "tiny.gguf", pad_vocab=13, context=1024,
                         chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}"))
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    env = {k: os.environ[k] for k in ("CASSPEC_CACHE", "TORCH_EXTENSIONS_DIR", "HOME") if k in os.environ}
    sigterm = signal.getsignal(signal.SIGTERM)  # (ray.init sets its own, and leaves it after ray.shutdown)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="casspec-test",
             runtime_env={"env_vars": env})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        cfg = ServeConfig(model_name="tiny", max_batch=4)
        serve.run(application(path, {"options": OPTIONS}, cfg, replicas=2, cpus_per_replica=1), name="casspec",
                  route_prefix="/")
        yield f"http://127.0.0.1:{port}", path
    finally:
        serve.shutdown()
        ray.shutdown()
        signal.signal(signal.SIGTERM, sigterm)


def test_two_replicas_answer_the_openai_client_as_the_server_does(deployed):
    from openai import BadRequestError, OpenAI

    url, path = deployed
    engine = Engine.from_pretrained(path, options=OPTIONS)
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    alone = engine.generate("ab ba ab", max_new_tokens=8, chat=False).text
    r = client.completions.create(model="tiny", prompt="ab ba ab", max_tokens=8, temperature=0)
    assert r.choices[0].text == alone and r.usage.completion_tokens == 8
    streamed = client.completions.create(model="tiny", prompt="ab ba ab", max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == alone
    chat_alone = engine.generate(CHAT, max_new_tokens=6).text
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0)
    assert r.choices[0].message.content == chat_alone
    chunks = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_alone
    with pytest.raises(BadRequestError, match="max_tokens must be an integer >= 1"):
        client.completions.create(model="tiny", prompt="ab", max_tokens=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{url}/v1/nothing").status_code == 404
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_a_conversation_returns_to_its_replica_and_metrics_are_summed(deployed):
    url, _ = deployed
    tokens = 0

    def call(prompt: str) -> str:
        nonlocal tokens
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={"prompt": prompt, "max_tokens": 3,
                                                                   "temperature": 0})
        assert r.status_code == 200
        tokens += r.json()["usage"]["completion_tokens"]
        return r.headers["x-casspec-replica"]

    opening = "ab ba " * 50  # (300 characters: a conversation's prompts start with it)
    same = {call(opening + "ab " * i) for i in range(5)}
    assert len(same) == 1
    seen = {call(f"{i:02d} " + "ab " * 90) for i in range(12)}  # twelve conversations: both replicas take some
    assert len(seen) == 2
    time.sleep(2.5)  # (each replica posts its metrics once a second)
    text = httpx.get(f"{url}/metrics").text
    counts = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("casspec:")}
    assert counts["casspec:generation_tokens_total"] >= tokens  # (and the first test's)
    assert text.count("# TYPE casspec:generation_tokens_total counter") == 1


def test_affinity_keys_and_summed_metrics():
    chat = b'{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}'
    later = (b'{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, '
             b'{"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}]}')
    assert affinity_key("/v1/chat/completions", chat) == affinity_key("/v1/chat/completions", later) != ""
    x, y = (f'{{"prompt": "{c * 300}"}}'.encode() for c in "xy")
    assert affinity_key("/v1/completions", x) != affinity_key("/v1/completions", y) != ""
    assert affinity_key("/v1/completions", b'{"prompt": "short"}') == ""  # (little to reuse: any replica)
    assert affinity_key("/v1/completions", b"not json") == affinity_key("/v1/completions", b"[1]") == ""
    a = "# TYPE casspec:x counter\ncasspec:x 2\ncasspec:h_bucket{le=\"1\"} 1\n"
    b = "# TYPE casspec:x counter\ncasspec:x 3.5\ncasspec:h_bucket{le=\"1\"} 4\n"
    assert summed([a, b]) == "# TYPE casspec:x counter\ncasspec:x 5.5\ncasspec:h_bucket{le=\"1\"} 5\n"
