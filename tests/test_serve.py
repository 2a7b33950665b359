"""`speccomp serve` (speccomp/serve.py): the OpenAI-compatible server over an engine, on a real uvicorn server on
loopback. Concurrent requests batch together and each gets its prompt's own greedy text; streams carry the same
tokens; bad requests get 400 naming the parameter; a client that goes away frees its row."""
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import speccomp
from test_speculative import hf_greedy
from tiny_models import tiny_llama

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

EOS = 2


def word_tokenizer(vocab: int = 96):
    """A word-level tokenizer over the tiny model's ids ("w0" .. "w95"), eos "w2", and a plain chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"w{EOS}", unk_token="w0")
    fast.chat_template = "{% for m in messages %}w1 {{ m['content'] }} {% endfor %}w3"
    return fast


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_hidden_layers=3, initializer_range=0.2, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def engine_path(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "engine"
    speccomp.compile(model, drafter="token_recycling", backend="onnxruntime").export(path, tokenizer=word_tokenizer())
    return path


@pytest.fixture(scope="module")
def server(engine_path):
    import uvicorn

    from speccomp.serve import make_app

    app = make_app(speccomp.load(engine_path), max_batch=4, kv_slots=1024)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", app
    srv.should_exit = True
    thread.join(10)


def metrics(url) -> dict:
    text = httpx.get(f"{url}/metrics").text
    return {line.split()[0].removeprefix("speccomp_"): float(line.split()[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_concurrent_requests_batch_and_each_gets_its_own_greedy_text(server, model):
    url, _ = server
    before = metrics(url)
    prompts = [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 14, 20, 7, 11)]

    def ask(prompt):
        return httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0},
                          timeout=60).json()

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, prompts))
    for prompt, answer in zip(prompts, answers):
        want = hf_greedy(model, torch.tensor([prompt]), 24, eos=EOS)[0, len(prompt):].tolist()
        want = want[: want.index(EOS) + 1] if EOS in want else want
        choice = answer["choices"][0]
        assert choice["token_ids"] == want
        assert choice["finish_reason"] == ("stop" if want[-1] == EOS else "length")
        words = lambda ids: " ".join(f"w{t}" for t in ids if t not in (0, EOS))  # noqa: E731 (w0, w2: special)
        assert words(prompt) + choice["text"] == words(prompt + want)  # the text reads on from the prompt
        assert answer["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(want),
                                   "total_tokens": len(prompt) + len(want)}
    after = metrics(url)
    tokens = sum(len(a["choices"][0]["token_ids"]) for a in answers)
    assert after["requests_total"] - before["requests_total"] == len(prompts)
    assert after["tokens_generated_total"] - before["tokens_generated_total"] == tokens
    # rows shared forwards (a batch of up to 4): some forward carried several rows, so there were fewer forwards than
    # row steps, and fewer than tokens. How many rows overlap depends on when the threads' requests arrive (a slow
    # machine staggers them), so the test asserts that they did share, not by how much.
    forwards = after["forwards_total"] - before["forwards_total"]
    row_steps = after["row_steps_total"] - before["row_steps_total"]
    assert forwards < row_steps and forwards < tokens
    assert row_steps / forwards <= 4  # --max-batch
    assert after["running_requests"] == after["waiting_requests"] == 0
    # null asks for the default (OpenAI clients send it for options they leave unset): top_p 1, no seed
    nulls = {"prompt": prompts[0], "max_tokens": 24, "temperature": 0, "top_p": None, "seed": None, "stop": None}
    assert httpx.post(f"{url}/v1/completions", json=nulls, timeout=60).json()["choices"] == answers[0]["choices"]


def test_chat_stream_carries_the_same_tokens(server, model):
    url, app = server
    body = {"messages": [{"role": "user", "content": "w5 w9 w11 w5 w9"}], "max_tokens": 16, "temperature": 0}
    whole = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    events = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    assert text == whole["choices"][0]["message"]["content"] and ids == whole["choices"][0]["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        counted = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all(c["usage"] is None for c in counted[:-1]) and counted[-1]["choices"] == []
    assert counted[-1]["usage"] == whole["usage"]  # OpenAI's stream_options: the counts in a last chunk
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": True, "stream_options": {"usage": 1}})
    assert r.status_code == 400 and "stream_options" in r.json()["error"]["message"]
    prompt = app.state.scheduler.engine.chat_ids(body["messages"])[0].tolist()
    assert prompt == [1, 5, 9, 11, 5, 9, 3]  # the chat template's rendering
    want = hf_greedy(model, torch.tensor([prompt]), 16, eos=EOS)[0, len(prompt):].tolist()
    assert ids == (want[: want.index(EOS) + 1] if EOS in want else want)


@pytest.mark.parametrize("body, param", [
    ({"prompt": [5, 6], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [5, 6], "max_tokens": 255}, "max_tokens"),  # past the model's 256 positions
    ({"prompt": [5, 6], "max_tokens": 200, "temperature": 0.5, "top_p": 2}, "top_p"),
    ({"prompt": [5, 600]}, "prompt"),
    ({"prompt": "w5 w6", "n": 2}, "n"),
    ({"prompt": "w5 w6", "temperature": -1}, "temperature"),
    ({"prompt": {"text": "w5"}}, "prompt"),
    ({"messages": "hello"}, "messages"),
    ({"prompt": "w5 w6", "presence_penalty": 0.5}, "presence_penalty"),  # would change the text: refused, not ignored
    ({"prompt": "w5 w6", "top_k": 5}, "top_k"),
    ({"prompt": "w5 w6", "response_format": {"type": "json_object"}}, "response_format"),
    ({"prompt": [5, 10**30]}, "prompt"),  # past int64: refused as any id outside the vocabulary (was a 500)
    ({"prompt": "w5 w6", "n": True}, "n"),  # true == 1 in Python, not in the API
    ({"prompt": "w5 w6", "stream": "false"}, "stream"),  # a string: was read as true, a stream
    ({"prompt": "w5 w6", "logprobs": 0}, "logprobs"),  # on /v1/completions 0 asks for the chosen tokens' logprobs
    # vLLM's extras and keys speccomp never heard of: were answered 200 with them ignored
    ({"prompt": "w5 w6", "ignore_eos": True}, "ignore_eos"),
    ({"prompt": "w5 w6", "min_tokens": 20}, "min_tokens"),
    ({"prompt": "w5 w6", "guided_choice": ["w7"]}, "guided_choice"),
    ({"messages": [{"role": "user", "content": "w5"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "banana", "content": "w5"}]}, "messages[0].role"),
    ({"prompt": "w5 w6", "max_completion_tokens": -1}, "max_completion_tokens"),  # was blamed on max_tokens
    ({"prompt": "w5 w6", "max_tokens": 4, "max_completion_tokens": 0}, "max_completion_tokens"),  # was never checked
    ({"prompt": "w5 w6", "max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
    ({"prompt": "w5 w6", "stream_options": {"include_usage": True}}, "stream_options"),  # without a stream
    # were 500s in text/plain: a lone surrogate (half an emoji) reached the tokenizer, or the error's own JSON; a
    # number past float's range reached float()
    ({"prompt": "w5 \ud83d"}, "body"),
    ({"prompt": [5, 6], "x\udc00": 1}, "body"),
    ({"prompt": [5, 6], "max_tokens": 4, "temperature": 10**400}, "temperature"),
    ({"prompt": [5, 6], "max_tokens": 4, "temperature": 0.5, "top_p": 10**400}, "top_p"),
])
def test_bad_requests_get_400_naming_the_parameter(server, body, param):
    url, _ = server
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(f"{url}{path}", content=json.dumps(body).encode(), timeout=30,  # "\\ud83d" escaped, as JSON allows
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and param in error["message"]


def test_openai_keys_that_change_no_text_are_accepted_and_greedy_drops_the_seed():
    """safety_identifier and prompt_cache_key (OpenAI's successors of `user`) were refused as unknown; a greedy request
    with a seed (a common pairing for repeatable runs) handed the seed on, which generate warns about."""
    from speccomp.serve import _options

    body = {"prompt": "w5", "safety_identifier": "u-1", "prompt_cache_key": "k", "user": "me", "temperature": 0,
            "seed": 7}
    options = _options(body, 16, chat=False)
    assert options["do_sample"] is False and options["seed"] is None
    assert _options({**body, "temperature": 0.5}, 16, chat=False)["seed"] == 7


def test_a_wrong_unset_value_a_greedy_requests_seed_and_the_other_endpoints_input_are_refused(server):
    """Were answered 200: a falsy value of the wrong type for an unsupported key (stop: 0 / false / {}), a seed that is
    no seed on a greedy request (checked only when sampling), and `messages` on /v1/completions or `prompt` on
    /v1/chat/completions (dropped). The empty values of each key's own type still mean "none"."""
    url, _ = server
    chat = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}
    text = {"prompt": "w5 w6", "max_tokens": 2}
    for path, body, param in (("completions", {**text, "stop": 0}, "stop"),
                              ("completions", {**text, "stop": False}, "stop"),
                              ("completions", {**text, "stop": {}}, "stop"),
                              ("completions", {**text, "temperature": 0, "seed": "abc"}, "seed"),
                              ("completions", {**text, "temperature": 0, "seed": -5}, "seed"),
                              ("completions", {**text, **chat}, "messages"),
                              ("chat/completions", {**chat, "prompt": "w7"}, "prompt")):
        r = httpx.post(f"{url}/v1/{path}", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{param}="), (body, r.text)
    for extra in ({"stop": []}, {"stop": ""}, {"logit_bias": {}}, {"top_k": -1}, {"top_k": 0}, {"logprobs": False},
                  {"temperature": 0, "seed": 3}):
        r = httpx.post(f"{url}/v1/completions", json={**text, **extra}, timeout=30)
        assert r.status_code == 200, (extra, r.text)


def test_a_request_larger_than_the_cache_is_refused_and_bad_json_too(server):
    url, app = server
    scheduler = app.state.scheduler
    slots = scheduler.batch.cache.shape[4]
    r = httpx.post(f"{url}/v1/completions", json={"prompt": list(range(3, 60)), "max_tokens": slots}, timeout=30)
    assert r.status_code == 400  # either the model's context or the server's cache names the limit
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    huge = b'{"prompt": [5], "max_tokens": ' + b"1" * 5000 + b"}"  # past Python's int-parsing limit: was a 500
    r = httpx.post(f"{url}/v1/completions", content=huge, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]


def test_text_to_an_engine_without_a_tokenizer_is_refused_naming_the_field(model, tmp_path):
    """An engine exported without tokenizer= takes token ids; text named no parameter before ("param": null)."""
    from speccomp.serve import _message_ids, _prompt_ids

    speccomp.compile(model, backend="onnxruntime").export(tmp_path / "engine")
    engine = speccomp.load(tmp_path / "engine")
    assert _prompt_ids(engine, {"prompt": [5, 6]}) == [5, 6]
    for field, call, body in (("prompt", _prompt_ids, {"prompt": "w5"}),
                              ("messages", _message_ids, {"messages": [{"role": "user", "content": "w5"}]})):
        with pytest.raises(speccomp.OptionError, match="exported without a tokenizer; send the prompt as token ids"
                           ) as refused:
            call(engine, body)
        assert refused.value.parameter == field


def test_a_client_that_goes_away_frees_its_row(server):
    url, _ = server
    before = metrics(url)
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 200, "stream": True,
                                                              "temperature": 0}, timeout=30) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["token_ids"]
    for _ in range(100):  # the scheduler notices between steps
        m = metrics(url)
        if m["requests_cancelled_total"] > before["requests_cancelled_total"] and m["running_requests"] == 0:
            break
        time.sleep(0.05)
    assert m["requests_cancelled_total"] == before["requests_cancelled_total"] + 1 and m["running_requests"] == 0
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    listed = httpx.get(f"{url}/v1/models").json()["data"][0]
    assert listed["object"] == "model" and isinstance(listed["created"], int) and listed["created"] > 1.7e9


def test_a_dropped_non_streaming_client_frees_its_row_while_tokens_still_flow(server):
    """A row that gains a token every step must not hide its client's disconnect (it was noticed only after half a
    second without tokens, so a steady row ran to max_tokens for nobody)."""
    url, app = server
    batch = app.state.scheduler.batch
    before, step = metrics(url), batch.step

    def slow_step():  # 100 ms a step: the disconnect is seen within ~8 steps (0.3 s + a check every 0.5 s), each
        time.sleep(0.1)  # adding at most a tree's worth of tokens, far from the reply's 240
        return step()

    batch.step = slow_step
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 240, "temperature": 0},
                       timeout=0.3)
        for _ in range(100):
            m = metrics(url)
            if m["requests_cancelled_total"] > before["requests_cancelled_total"] and m["running_requests"] == 0:
                break
            time.sleep(0.05)
    finally:
        batch.step = step
    assert m["requests_cancelled_total"] == before["requests_cancelled_total"] + 1 and m["running_requests"] == 0
    assert m["tokens_generated_total"] - before["tokens_generated_total"] < 240  # freed before its reply was done


def test_max_tokens_unset_asks_for_what_the_context_leaves(server, model):
    """A chat request without max_tokens (default 256) on a prompt that leaves fewer positions gets what fits (as
    OpenAI's API), not a 400 about a max_tokens the client never sent; a prompt that fills the context is refused."""
    url, app = server
    messages = [{"role": "user", "content": " ".join(f"w{5 + i % 80}" for i in range(200))}]
    prompt = app.state.scheduler.engine.chat_ids(messages)[0].tolist()
    assert 200 < len(prompt) < 250  # 256 positions: fewer than the default 256 new tokens fit
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(prompt)
    want = hf_greedy(model, torch.tensor([prompt]), 256 - len(prompt), eos=EOS)[0, len(prompt):].tolist()
    assert r.json()["choices"][0]["token_ids"] == (want[: want.index(EOS) + 1] if EOS in want else want)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [5 + i % 80 for i in range(256)], "temperature": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text  # not max_tokens: nobody sent it
    assert "256 tokens" in r.json()["error"]["message"]


def test_reply_text_reads_on_from_the_prompt_with_a_sentencepiece_tokenizer():
    """A Metaspace (SentencePiece) tokenizer drops the leading space of a decoded text's first word: the reply is
    decoded behind the prompt's last tokens, so prompt + reply reads as the whole sequence decoded."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from speccomp.serve import _text

    vocab = {f"\u2581w{i}": i for i in range(96)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="\u2581w0"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    engine = SimpleNamespace(manifest={"tokenizer": {"file": "tokenizer.json"}}, decode=tok.decode)
    prompt, reply = tok.encode("w5 w6").ids, [64, 33]
    assert tok.decode(reply) == "w64 w33"  # alone: no space before the first word
    assert tok.decode(prompt) + _text(engine, reply, prompt) == tok.decode(prompt + reply) == "w5 w6 w64 w33"
    assert _text(SimpleNamespace(manifest={}), reply, prompt) == ""  # no tokenizer: token ids only


def test_a_chat_template_that_refuses_the_messages_is_a_400_on_messages(engine_path):
    """Chat templates (Llama-2's, Mistral's, Gemma's) call raise_exception() on a conversation they refuse, as
    transformers defines it: the engine renders them too, and the refusal names `messages` (was a 500: jinja's
    'raise_exception is undefined')."""
    engine = speccomp.load(engine_path)
    info = engine.manifest["tokenizer"]
    info["chat_template"] = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                             "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
                             "w1 {{ m['content'] }} {% endfor %}w3")
    engine._template = engine._chat_template()
    assert engine.chat_ids([{"role": "user", "content": "w5"}])[0].tolist() == [1, 5, 3]
    with pytest.raises(speccomp.OptionError, match="messages=.*roles must alternate") as refused:
        engine.chat_ids([{"role": "assistant", "content": "w5"}])
    assert refused.value.parameter == "messages"  # serve answers a SpeccompError 400, naming its parameter


def test_a_failed_step_answers_500_and_a_client_gone_while_queued_is_counted(engine_path):
    """A batch step that fails is the server's fault: its rows get HTTP 500 (server_error, counted as failed, not as
    refused) and the server goes on. A request whose client left while it waited is counted as cancelled when the
    queue drops it, and the waiting gauge leaves it out."""
    import asyncio

    from fastapi.testclient import TestClient

    from speccomp.serve import Job, make_app

    app = make_app(speccomp.load(engine_path), max_batch=2, kv_slots=256)
    scheduler, body = app.state.scheduler, {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}

    def counts(text):
        return {k.removeprefix("speccomp_"): float(v) for k, v in
                (line.split() for line in text.splitlines() if line.startswith("speccomp_"))}

    with TestClient(app) as client:
        step = scheduler.batch.step
        scheduler.batch.step = lambda: (_ for _ in ()).throw(RuntimeError("boom"))
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error" and "boom" in r.text
        scheduler.batch.step = step
        assert client.post("/v1/completions", json=body).status_code == 200
        m = counts(client.get("/metrics").text)
        assert m["requests_failed_total"] == 1 and m["requests_refused_total"] == 0
        assert m["requests_finished_total"] == 1 and client.get("/health").status_code == 200
        assert m["forwards_total"] == scheduler.batch.forwards  # the failed step ran none (was counted one)
    # the app has stopped its scheduler thread: its queue is driven by hand from here
    loop = asyncio.new_event_loop()
    gone, kept = Job([5, 6], {}, loop), Job([5, 6, 7], {}, loop)
    gone.cancelled, kept.row = True, scheduler.engine.row([5, 6, 7], max_new_tokens=4)
    scheduler.waiting.extend([gone, kept])
    assert counts(scheduler.metrics())["waiting_requests"] == 1
    scheduler._admit()
    assert scheduler.counts["cancelled"] == 1 and not scheduler.waiting and len(scheduler.jobs) == 1
    loop.close()


def test_an_engine_whose_drafter_cannot_batch_is_served_plainly_with_no_draft(model, tmp_path, monkeypatch):
    """early_exit drafts over the target's own cache, which a batch shares: serve refuses it naming --no-draft, and
    with it (load(draft=False)) serves plain decoding on the same target graph, HF greedy's text."""
    from fastapi.testclient import TestClient

    from speccomp import cli
    from speccomp.engine.runtime import EngineError
    from speccomp.serve import make_app

    path = tmp_path / "early_exit"
    speccomp.compile(model, drafter="early_exit", drafter_options={"exit_layer": 1}, backend="onnxruntime").export(
        path, tokenizer=word_tokenizer())
    with pytest.raises(EngineError, match="--no-draft"):
        make_app(speccomp.load(path), max_batch=1)
    with pytest.raises(speccomp.OptionError, match="^max_batch=0: must be a positive int"):  # was: every request hung
        make_app(speccomp.load(path, draft=False), max_batch=0)
    with pytest.raises(speccomp.OptionError, match="^kv_slots=10000000000000: is a larger KV cache than"):
        make_app(speccomp.load(path, draft=False), kv_slots=10**13)  # was numpy's MemoryError and its traceback
    with TestClient(make_app(speccomp.load(path, draft=False), max_batch=2, kv_slots=256)) as client:
        answer = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}).json()
    want = hf_greedy(model, torch.tensor([[5, 6, 7]]), 8, eos=EOS)[0, 3:].tolist()
    assert answer["choices"][0]["token_ids"] == (want[: want.index(EOS) + 1] if EOS in want else want)
    seen = {}
    monkeypatch.setattr("speccomp.serve.serve", lambda engine, **options: seen.update(options))
    assert cli.main(["serve", str(path), "--no-draft"]) == 0 and seen["draft"] is False
    assert cli.main(["serve", str(path), "--port", "99999"]) == 2  # no such port: refused, not bound elsewhere


REPEATED = ("input", "output", "parameters", "instance_group")  # Triton's repeated message fields


def pbtxt(text: str) -> dict:
    """A protobuf text-format message as nested dicts (a repeated field: a list), enough to read a Triton config."""
    import re

    tokens = re.findall(r'"[^"]*"|[{}\[\]:,]|[^\s{}\[\]:,"]+', text)
    pos = 0

    def value():
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok == "{":
            return message("}")
        if tok == "[":
            items = []
            while tokens[pos] != "]":
                items.append(value())
                pos += tokens[pos] == ","
            pos += 1
            return items
        return tok[1:-1] if tok.startswith('"') else int(tok) if tok.lstrip("-").isdigit() else tok

    def message(end):
        nonlocal pos
        out = {}
        while pos < len(tokens) and tokens[pos] != end:
            key = tokens[pos]
            pos += 1 + (tokens[pos + 1] == ":")
            v = value()
            if key in REPEATED:  # `input [ {...}, {...} ]` and `parameters {...} parameters {...}` alike
                out.setdefault(key, []).extend(v if isinstance(v, list) else [v])
            else:
                out[key] = v
        pos += 1
        return out

    return message(None)


def test_triton_model_repository(engine_path, model, tmp_path, monkeypatch):
    """export-triton writes a config Triton reads (checked field by field) and a model.py whose class, run against
    the copied engine with Triton's Python-backend calls stood in for, answers each request with its prompt's
    greedy text (requests of one budget decoded as one batch) and a bad request with its own error."""
    import importlib.util
    import sys
    import types

    import numpy as np

    import os
    from pathlib import Path

    from speccomp.engine.runtime import EngineError
    from speccomp.engine.triton_repository import export_triton_repository
    from speccomp.errors import OptionError

    repo = tmp_path / "repo"
    folder = export_triton_repository(engine_path, repo, name="tiny", max_new_tokens=12)
    config = pbtxt((folder / "config.pbtxt").read_text())
    assert config["name"] == "tiny" and config["backend"] == "python" and config["max_batch_size"] == 0
    assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [
        ("input_ids", "TYPE_INT64", [-1]), ("max_new_tokens", "TYPE_INT64", [1])]
    assert config["input"][1]["optional"] == "true"
    assert [(o["name"], o["data_type"], o["dims"]) for o in config["output"]] == [("output_ids", "TYPE_INT64", [-1])]
    assert config["instance_group"] == [{"count": 1, "kind": "KIND_CPU"}]
    assert (folder / "1" / "engine" / "manifest.json").is_file()

    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, array

        def as_numpy(self):
            return self.array

    class Response:
        def __init__(self, output_tensors=None, error=None):
            self.outputs, self.error = output_tensors, error

    class Request:
        def __init__(self, **inputs):
            self.inputs = {k: Tensor(k, np.asarray(v, dtype=np.int64)) for k, v in inputs.items()}

    utils = types.SimpleNamespace(Tensor=Tensor, InferenceResponse=Response, TritonError=str,
                                  get_input_tensor_by_name=lambda request, name: request.inputs.get(name))
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", utils)
    spec = importlib.util.spec_from_file_location("triton_model", folder / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parameters = {p["key"]: {"string_value": p["value"]["string_value"]} for p in config["parameters"]}
    triton = module.TritonPythonModel()
    triton.initialize({"model_config": json.dumps({"parameters": parameters}), "model_repository": str(folder),
                       "model_version": "1"})
    prompts = [[5, 9, 13, 5, 9], [7, 8, 20, 31, 7, 8, 20], [4, 6]]
    answers = triton.execute([Request(input_ids=prompts[0]), Request(input_ids=prompts[1]),
                              Request(input_ids=prompts[2], max_new_tokens=[6]), Request(input_ids=[5, 500])])
    for prompt, answer, n in zip(prompts, answers, (12, 12, 6)):
        want = hf_greedy(model, torch.tensor([prompt]), n, eos=EOS)[0, len(prompt):].tolist()
        assert answer.error is None and answer.outputs[0].array.tolist() == (
            want[: want.index(EOS) + 1] if EOS in want else want)
    assert answers[3].outputs is None and "input_ids" in answers[3].error
    with pytest.raises(EngineError, match="already holds a speccomp Triton model"):
        export_triton_repository(engine_path, repo, name="tiny")
    export_triton_repository(engine_path, repo, name="tiny", overwrite=True)
    (repo / "other").mkdir()
    (repo / "other" / "config.pbtxt").write_text("name: \"other\"")
    with pytest.raises(EngineError, match="not a speccomp Triton model"):
        export_triton_repository(engine_path, repo, name="other", overwrite=True)
    assert (repo / "other" / "config.pbtxt").read_text() == 'name: "other"'  # a user's files are never lost
    # re-exported from the engine copied into it (to change its settings): built beside it, then swapped in
    copy = repo / "tiny" / "1" / "engine"
    export_triton_repository(copy, repo, name="tiny", max_new_tokens=7, overwrite=True)
    params = {q["key"]: q["value"]["string_value"] for q in pbtxt((repo / "tiny" / "config.pbtxt").read_text())["parameters"]}
    assert (copy / "manifest.json").is_file() and params["default_max_new_tokens"] == "7"
    mask = os.umask(0o022)
    os.umask(mask)
    assert (repo / "tiny").stat().st_mode & 0o777 == 0o777 & ~mask  # readable as a mkdir'd folder (not mkdtemp's 0700)
    with pytest.raises(OptionError, match="out=.*inside the engine it copies"):
        export_triton_repository(engine_path, Path(engine_path) / "repo")
    assert not (Path(engine_path) / "repo").exists()
    # a copy that fails leaves the old model whole and nothing half-written beside it
    monkeypatch.setattr("shutil.copyfile", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        export_triton_repository(engine_path, repo, name="tiny", overwrite=True)
    assert (copy / "manifest.json").is_file() and (repo / "tiny" / "1" / "model.py").is_file()
    assert sorted(q.name for q in repo.iterdir()) == ["other", "tiny"]
    monkeypatch.undo()
    # a user's files inside the model (beside model.py, inside its engine copy) are never replaced with it
    for mine in (repo / "tiny" / "1" / "my_notes.txt", copy / "extra.bin"):
        mine.write_text("precious")
        with pytest.raises(EngineError, match=f"files it did not write.*{mine.name}"):
            export_triton_repository(engine_path, repo, name="tiny", overwrite=True)
        assert mine.read_text() == "precious"
        mine.unlink()
    (Path(engine_path) / "notes.txt").write_text("beside the engine")  # copied? only the files its manifest names
    try:
        export_triton_repository(engine_path, repo, name="tiny", overwrite=True)
    finally:
        (Path(engine_path) / "notes.txt").unlink()
    assert not (copy / "notes.txt").exists() and (copy / "manifest.json").is_file()
    for bad in (0, -5, 1.5, "12", True, '1"\n}'):
        with pytest.raises(OptionError, match="max_new_tokens=.*positive int"):
            export_triton_repository(engine_path, repo, name="fresh", max_new_tokens=bad)
    with pytest.raises(OptionError, match="name=5"):
        export_triton_repository(engine_path, repo, name=5)
    assert not (repo / "fresh").exists()
