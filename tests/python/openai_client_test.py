"""The official `openai` Python package against a live router's OpenAI-compatible HTTP API.

Usage: python3 tests/python/openai_client_test.py BASE_URL   (e.g. http://127.0.0.1:P/v1)
The model has random weights (text is gibberish), so the checks are on shapes and invariants,
never on content. Prints one line per check and a closing summary line; exits non-zero on
failure.
"""

import json
import re
import sys
import traceback
import urllib.request

import openai

PROMPT = "The quick brown fox jumps over"
SYSTEM = {"role": "system", "content": "You are a terse assistant."}
USER = {"role": "user", "content": "Name three colours."}


def main():
    base_url = sys.argv[1]
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=60, max_retries=0)
    model = None
    context = None

    def complete(**kw):
        return client.completions.create(model=model, **kw)

    def chat(**kw):
        return client.chat.completions.create(model=model, **kw)

    def tokenize(text):
        # vLLM's /tokenize sits beside /v1, not under it.
        url = base_url.rstrip("/").removesuffix("/v1") + "/tokenize"
        body = json.dumps({"model": model, "prompt": text}).encode()
        request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.load(response)["tokens"]

    def greedy_text(prompt, max_tokens):
        r = complete(prompt=prompt, max_tokens=max_tokens, temperature=0)
        return r.choices[0].text

    def models():
        nonlocal model, context
        listed = list(client.models.list())
        assert len(listed) == 1, f"expected one model, got {[m.id for m in listed]}"
        assert listed[0].id, f"model without an id: {listed[0]}"
        model = listed[0].id
        # vLLM's extension: the context length.
        context = getattr(listed[0], "max_model_len", None)
        assert isinstance(context, int) and context > 0, f"max_model_len {context!r}"

    def completions():
        r = complete(prompt=PROMPT, max_tokens=8, temperature=0)
        assert r.object == "text_completion", f"object {r.object!r}"
        assert r.model == model, f"response model {r.model!r} != {model!r}"
        assert len(r.choices) == 1, f"expected one choice, got {len(r.choices)}"
        c = r.choices[0]
        assert c.index == 0, f"choice index {c.index}"
        assert c.finish_reason == "length", f"finish_reason {c.finish_reason!r}, expected 'length'"
        u = r.usage
        assert u.completion_tokens == 8, f"completion_tokens {u.completion_tokens}, expected 8"
        assert u.prompt_tokens > 0, f"prompt_tokens {u.prompt_tokens}"
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens, f"usage {u}"
        again = complete(prompt=PROMPT, max_tokens=8, temperature=0)
        assert again.choices[0].text == c.text, (
            f"greedy differs between runs: {c.text!r} vs {again.choices[0].text!r}"
        )
        seeded = [
            complete(prompt=PROMPT, max_tokens=8, temperature=1, seed=7).choices[0].text
            for _ in range(2)
        ]
        assert seeded[0] == seeded[1], f"seed=7 differs between runs: {seeded!r}"

    def completions_stream():
        want = greedy_text(PROMPT, 8)
        chunks = list(
            complete(
                prompt=PROMPT,
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert len(chunks) >= 2, f"only {len(chunks)} chunks"
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == want, f"streamed text {text!r} != non-streamed {want!r}"
        reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
        assert [r for r in reasons if r] == ["length"], f"finish_reasons {reasons}"
        ids = {ch.id for ch in chunks}
        assert len(ids) == 1, f"chunks carry several ids: {ids}"
        last = chunks[-1]
        assert last.choices == [], f"usage chunk has choices: {last.choices}"
        assert last.usage is not None, "last chunk has no usage"
        assert last.usage.completion_tokens == 8, f"usage {last.usage}"
        assert all(ch.usage is None for ch in chunks[:-1]), "usage before the last chunk"

    def continuous_usage():
        # vLLM's stream_options.continuous_usage_stats: every chunk has its choice's usage so far.
        options = {"include_usage": True, "continuous_usage_stats": True}
        chunks = list(
            chat(
                messages=[SYSTEM, USER],
                max_tokens=5,
                n=2,
                temperature=0,
                stream=True,
                stream_options=options,
                extra_body={"ignore_eos": True},
            )
        )
        final = chunks[-1]
        assert final.choices == [] and final.usage is not None, f"last chunk {final}"
        assert final.usage.completion_tokens == 10, f"final usage {final.usage}"
        so_far = {}
        for ch in chunks[:-1]:
            assert ch.usage is not None, f"a chunk without usage: {ch}"
            (c,) = ch.choices
            u = ch.usage
            assert u.prompt_tokens == final.usage.prompt_tokens, f"usage {u} vs {final.usage}"
            assert u.total_tokens == u.prompt_tokens + u.completion_tokens, f"usage {u}"
            assert u.completion_tokens >= so_far.get(c.index, 0), f"went down: {u}"
            so_far[c.index] = u.completion_tokens
        assert so_far == {0: 5, 1: 5}, f"per-choice counts {so_far}"

    def chat_n():
        r = chat(
            messages=[SYSTEM, USER], max_tokens=6, n=3, seed=1, temperature=1, logprobs=True
        )
        assert r.object == "chat.completion", f"object {r.object!r}"
        assert sorted(c.index for c in r.choices) == [0, 1, 2], (
            f"choice indexes {[c.index for c in r.choices]}"
        )
        per_choice = []
        for c in r.choices:
            assert c.message.role == "assistant", f"choice {c.index} role {c.message.role!r}"
            assert c.finish_reason in ("length", "stop"), f"finish_reason {c.finish_reason!r}"
            assert c.logprobs is not None and c.logprobs.content is not None, (
                f"choice {c.index} has no logprobs"
            )
            per_choice.append(len(c.logprobs.content))
            if c.finish_reason == "length":
                assert per_choice[-1] == 6, f"choice {c.index} hit length after {per_choice[-1]}"
        assert r.usage.completion_tokens == sum(per_choice), (
            f"completion_tokens {r.usage.completion_tokens} != sum of choices {per_choice}"
        )
        if all(c.finish_reason == "length" for c in r.choices):
            assert r.usage.completion_tokens == 18, f"usage {r.usage}"
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    def chat_stream():
        kw = dict(messages=[SYSTEM, USER], max_tokens=6, n=2, seed=3, temperature=1)
        whole = chat(**kw)
        chunks = list(chat(stream=True, **kw))
        assert len({ch.id for ch in chunks}) == 1, "chunks carry several ids"
        assert all(ch.object == "chat.completion.chunk" for ch in chunks)
        first_delta = {}
        content = {0: "", 1: ""}
        reasoning = {0: "", 1: ""}
        finishes = {0: [], 1: []}
        for ch in chunks:
            for c in ch.choices:
                assert c.index in content, f"unexpected choice index {c.index}"
                first_delta.setdefault(c.index, c.delta)
                content[c.index] += c.delta.content or ""
                reasoning[c.index] += getattr(c.delta, "reasoning_content", None) or ""
                if c.finish_reason is not None:
                    finishes[c.index].append(c.finish_reason)
        for i in (0, 1):
            assert i in first_delta, f"choice {i} never streamed"
            assert first_delta[i].role == "assistant", (
                f"choice {i} first delta role {first_delta[i].role!r}"
            )
            assert len(finishes[i]) == 1, f"choice {i} finish_reasons {finishes[i]}"
            assert content[i] or reasoning[i], f"choice {i} streamed nothing"
        for c in whole.choices:
            want = (c.message.content or "", getattr(c.message, "reasoning_content", None) or "")
            got = (content[c.index], reasoning[c.index])
            assert got == want, f"choice {c.index}: streamed {got!r} != non-streamed {want!r}"
            assert finishes[c.index] == [c.finish_reason], (
                f"choice {c.index}: streamed finish {finishes[c.index]} vs {c.finish_reason!r}"
            )

    def logprobs():
        r = chat(messages=[USER], max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
        c = r.choices[0]
        assert c.finish_reason == "length", f"finish_reason {c.finish_reason!r}"
        entries = c.logprobs.content
        assert len(entries) == 4, f"{len(entries)} logprob entries, expected 4"
        for e in entries:
            assert len(e.top_logprobs) == 3, f"{len(e.top_logprobs)} top_logprobs for {e.token!r}"
            assert e.logprob <= 0, f"logprob {e.logprob} > 0"
            assert isinstance(e.bytes, list) and all(isinstance(b, int) for b in e.bytes), e.bytes
            assert bytes(e.bytes).decode("utf-8", "replace") == e.token or "\ufffd" in e.token, (
                f"bytes {e.bytes} do not spell {e.token!r}"
            )
            for t in e.top_logprobs:
                assert t.logprob <= 0, f"top logprob {t.logprob} > 0"
            # Greedy: the chosen token is the most likely one.
            assert e.logprob >= max(t.logprob for t in e.top_logprobs) - 1e-4, (
                f"greedy chose {e.logprob} below top {[t.logprob for t in e.top_logprobs]}"
            )

        r = complete(prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
        c = r.choices[0]
        lp = c.logprobs
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            got = getattr(lp, name)
            assert got is not None and len(got) == 4, f"logprobs.{name} {got!r}, expected 4 long"
        assert all(len(t) <= 2 and len(t) >= 1 for t in lp.top_logprobs), lp.top_logprobs
        assert all(x <= 0 for x in lp.token_logprobs), lp.token_logprobs
        assert "".join(lp.tokens) == c.text, f"tokens {lp.tokens!r} do not join into {c.text!r}"
        assert lp.text_offset == sorted(lp.text_offset), f"text_offset {lp.text_offset}"

    def echo():
        prompt = "Hello world, this is"
        r = complete(prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=1)
        c = r.choices[0]
        assert c.text.startswith(prompt), f"echoed text {c.text!r} does not start with {prompt!r}"
        lp = c.logprobs
        assert lp.token_logprobs[0] is None, f"first token_logprob {lp.token_logprobs[0]!r}"
        assert all(x is not None for x in lp.token_logprobs[1:]), lp.token_logprobs
        n = r.usage.prompt_tokens + 2
        assert len(lp.tokens) == n, f"{len(lp.tokens)} tokens, expected prompt {n - 2} + 2"
        assert len(lp.token_logprobs) == n and len(lp.text_offset) == n, lp
        assert lp.text_offset[0] == 0, f"text_offset {lp.text_offset}"
        assert "".join(lp.tokens[: n - 2]) == prompt, f"prompt tokens {lp.tokens[: n - 2]!r}"

    def structured():
        schema = {
            "type": "object",
            "properties": {"age": {"type": "integer"}},
            "required": ["age"],
        }
        r = chat(
            messages=[SYSTEM, USER],
            max_tokens=40,
            temperature=1,
            seed=11,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        )
        c = r.choices[0]
        assert c.finish_reason in ("stop", "length"), f"finish_reason {c.finish_reason!r}"
        if c.finish_reason == "stop":
            try:
                value = json.loads(c.message.content)
            except ValueError as e:
                raise AssertionError(f"not JSON ({e}): {c.message.content!r}")
            assert isinstance(value, dict) and isinstance(value.get("age"), int), value
            assert not isinstance(value["age"], bool), value
        r = chat(
            messages=[USER],
            max_tokens=10,
            temperature=1,
            extra_body={"guided_choice": ["yes", "no"]},
        )
        c = r.choices[0]
        assert c.message.content in ("yes", "no"), f"guided_choice gave {c.message.content!r}"
        assert c.finish_reason == "stop", f"finish_reason {c.finish_reason!r}"
        # A GBNF grammar, as vLLM takes it: a date or a short list of words.
        grammar = 'root ::= date | words\ndate ::= [0-9]{4} "-" [0-9]{2}\nwords ::= [a-z]+ ("," [a-z]+){0,2}'
        r = chat(
            messages=[USER],
            max_tokens=30,
            temperature=1,
            seed=2,
            extra_body={"structured_outputs": {"grammar": grammar}},
        )
        c = r.choices[0]
        text = c.message.content
        if c.finish_reason == "stop":
            assert re.fullmatch(r"[0-9]{4}-[0-9]{2}|[a-z]+(,[a-z]+){0,2}", text), text
        else:
            assert re.fullmatch(r"[0-9-]*|[a-z,]*", text), text
        # Any JSON object, streamed. Quotes and braces favoured so that the random model
        # closes its object.
        quote, brace = (tokenize(t)[0] for t in ('"', "}"))
        closed = 0
        for seed in range(4):
            stream = chat(
                messages=[USER],
                max_tokens=48,
                temperature=1,
                seed=seed,
                stream=True,
                response_format={"type": "json_object"},
                logit_bias={str(quote): 8, str(brace): 6},
            )
            text, finish = "", None
            for chunk in stream:
                for ch in chunk.choices:
                    text += ch.delta.content or ""
                    finish = ch.finish_reason or finish
            assert text.startswith("{"), f"json_object gave {text!r}"
            if finish == "stop":
                try:
                    value = json.loads(text)
                except ValueError as e:
                    raise AssertionError(f"json_object: not JSON ({e}): {text!r}")
                assert isinstance(value, dict), value
                closed += 1
        assert closed > 0, "json_object: no object was closed in 4 tries"

    def tool_call_stream():
        # A named tool_choice forces one call (the router runs with --tool-call-parser hermes).
        # Streamed, the call comes in parts the client joins by index: the first names it,
        # the rest add to its arguments; they add up to the unstreamed answer's call.
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}},
                        "required": ["city"],
                    },
                },
            }
        ]
        forced = {"type": "function", "function": {"name": "get_weather"}}
        kw = dict(messages=[USER], tools=tools, tool_choice=forced, max_tokens=40, temperature=0)
        whole = chat(**kw).choices[0]
        assert whole.message.tool_calls, f"no tool call in {whole.message}"
        want = whole.message.tool_calls[0].function
        calls, parts, finish = {}, 0, None
        for chunk in chat(stream=True, **kw):
            for ch in chunk.choices:
                for part in ch.delta.tool_calls or []:
                    parts += 1
                    if part.index not in calls:
                        assert part.id and part.type == "function", part
                        assert part.function.name == "get_weather", part
                        calls[part.index] = ""
                    else:
                        assert part.id is None and part.function.name is None, part
                    calls[part.index] += part.function.arguments or ""
                finish = ch.finish_reason or finish
        assert list(calls) == [0], f"calls {calls}"
        assert calls[0] == want.arguments, f"streamed {calls[0]!r}, whole {want.arguments!r}"
        assert calls[0].startswith('{"city":'), calls[0]
        assert parts > 1, f"the call came in {parts} part(s)"
        assert finish == whole.finish_reason, f"finish {finish!r} vs {whole.finish_reason!r}"
        print(f"     {parts} parts, finish {finish}")

    def stop():
        text = greedy_text(PROMPT, 12)
        # A stop string from the middle of the text: no whitespace, no replacement character.
        stop_at = None
        for start in range(max(1, len(text) // 3), len(text) - 2):
            candidate = text[start : start + 2]
            if candidate.strip() == candidate and "\ufffd" not in candidate:
                stop_at = candidate
                break
        assert stop_at, f"no stop string to pick in {text!r}"
        r = complete(prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop_at])
        c = r.choices[0]
        want = text[: text.find(stop_at)]
        assert c.finish_reason == "stop", (
            f"stop={stop_at!r} in {text!r}: finish_reason {c.finish_reason!r}"
        )
        assert c.text == want, f"stop={stop_at!r} in {text!r}: text {c.text!r}, expected {want!r}"

    def errors():
        cases = {
            "temperature=-1": lambda: complete(prompt="x", max_tokens=2, temperature=-1),
            "unknown field": lambda: complete(
                prompt="x", max_tokens=2, extra_body={"temprature": 1}
            ),
            # One prompt token plus the whole context is one token too many.
            "max_tokens over the context": lambda: complete(prompt="x", max_tokens=context),
            "chat temperature=-1": lambda: chat(messages=[USER], max_tokens=2, temperature=-1),
        }
        messages = {}
        for name, call in cases.items():
            try:
                r = call()
            except openai.BadRequestError as e:
                assert e.status_code == 400, (name, e.status_code)
                message = (e.body or {}).get("message") if isinstance(e.body, dict) else None
                assert message, f"{name}: empty error message in {e.body!r}"
                messages[name] = message
            else:
                raise AssertionError(f"{name} was accepted: {r}")
        # An unknown model is 404 (NotFoundError), as OpenAI and vLLM answer it.
        try:
            r = client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
        except openai.NotFoundError as e:
            assert e.status_code == 404, e.status_code
            assert "no-such-model" in str(e), str(e)
        else:
            raise AssertionError(f"an unknown model was accepted: {r}")
        print(f"     e.g. unknown field: {messages['unknown field']}")

    def request_id():
        tagged = client.with_options(default_headers={"x-request-id": "py-abc"})
        r = tagged.completions.with_raw_response.create(
            model=model, prompt="x", max_tokens=2, temperature=0
        )
        assert r.headers.get("x-request-id") == "py-abc", f"header {r.headers.get('x-request-id')!r}"
        r = r.parse()
        assert "py-abc" in r.id, f"id {r.id!r} does not contain the x-request-id"
        assert r.id == "cmpl-py-abc", f"id {r.id!r}"
        r = tagged.chat.completions.create(model=model, messages=[USER], max_tokens=2)
        assert r.id == "chatcmpl-py-abc", f"chat id {r.id!r}"

    checks = [
        models,
        completions,
        completions_stream,
        continuous_usage,
        chat_n,
        chat_stream,
        logprobs,
        echo,
        structured,
        tool_call_stream,
        stop,
        errors,
        request_id,
    ]
    passed = failed = 0
    for check in checks:
        try:
            check()
            passed += 1
            print(f"ok   {check.__name__}")
        except Exception:
            failed += 1
            print(f"FAIL {check.__name__}")
            traceback.print_exc()
            if model is None:
                break
    print(f"openai client: {passed} checks passed, {failed} failed against {base_url}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
