"""A real third-party client (Python grpcio, stubs generated from proto/) against a live router.

Usage: python3 tests/python/client_test.py ROUTER_ADDR
Prints one line per check and a closing "N passed, M failed" line; exits non-zero on failure.
"""

import json
import os
import subprocess
import sys
import tempfile
import traceback

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROTO = os.path.join(ROOT, "proto")


def generate_stubs(out):
    from grpc_tools import protoc
    import grpc_tools

    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    files = ["pd/v1/common.proto", "pd/v1/generation.proto", "pd/v1/node.proto"]
    rc = protoc.main(
        ["protoc", f"-I{PROTO}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}"]
        + files
    )
    if rc != 0:
        raise RuntimeError(f"protoc failed with {rc}")
    sys.path.insert(0, out)


def main():
    router = sys.argv[1]
    out = tempfile.mkdtemp()
    generate_stubs(out)
    from pd.v1 import common_pb2, generation_pb2, generation_pb2_grpc  # noqa: E402

    channel = grpc.insecure_channel(router)
    stub = generation_pb2_grpc.GenerationStub(channel)
    greedy = common_pb2.SamplingParams(temperature=0.0)

    def stream_text():
        req = generation_pb2.GenerateRequest(
            text="Hello from Python", sampling=greedy, max_tokens=6, ignore_eos=True
        )
        chunks = list(stub.Generate(req, timeout=60))
        ids = [t for c in chunks for t in c.token_ids]
        assert len(ids) == 6, ids
        last = chunks[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH, last
        assert last.WhichOneof("stop_reason") is None, last
        assert last.usage.completion_tokens == 6 and last.usage.prompt_tokens > 0, last.usage
        assert all(c.request_id == chunks[0].request_id for c in chunks)
        # The first chunk tells the prompt's length at once; later ones do not.
        assert chunks[0].HasField("prompt_tokens"), chunks[0]
        assert chunks[0].prompt_tokens == last.usage.prompt_tokens, (chunks[0], last.usage)
        assert not any(c.HasField("prompt_tokens") for c in chunks[1:]), chunks
        # OpenAI-style penalties and a minimum length are accepted and honoured.
        penalised = common_pb2.SamplingParams(
            temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5, min_tokens=4
        )
        req = generation_pb2.GenerateRequest(
            text="Hello from Python", sampling=penalised, max_tokens=6
        )
        ids = [t for c in stub.Generate(req, timeout=60) for t in c.token_ids]
        assert 4 <= len(ids) <= 6, ids
        # Function tools (JSON objects) are rendered into a chat prompt by the template.
        def chat_prompt_tokens(tools):
            req = generation_pb2.GenerateRequest(
                chat=generation_pb2.ChatInput(
                    messages=[generation_pb2.ChatMessage(role="user", content="Weather in Paris?")],
                    tools=tools,
                ),
                sampling=greedy,
                max_tokens=1,
            )
            return list(stub.Generate(req, timeout=60))[-1].usage.prompt_tokens

        tool = json.dumps({"type": "function", "function": {"name": "get_weather", "parameters": {}}})
        assert chat_prompt_tokens([tool]) > chat_prompt_tokens([]) + 20
        # A logit bias map and allowed ids confine every token.
        confined = common_pb2.SamplingParams(
            temperature=1.0, allowed_token_ids=[11, 22, 33], logit_bias={22: 2.0, 44: 100.0}
        )
        req = generation_pb2.GenerateRequest(
            text="Hello from Python", sampling=confined, max_tokens=6, ignore_eos=True
        )
        ids = [t for c in stub.Generate(req, timeout=60) for t in c.token_ids]
        assert len(ids) == 6 and set(ids) <= {11, 22, 33}, ids

    def choices():
        # n choices: chunks tagged by index, each choice the seeded request seed + i.
        def request(seed, n=None):
            sampling = common_pb2.SamplingParams(temperature=1.0, seed=seed)
            return generation_pb2.GenerateRequest(
                text="Choices from Python", sampling=sampling, max_tokens=5, ignore_eos=True, n=n
            )

        ids = {}
        finished = []
        for c in stub.Generate(request(9, n=3), timeout=60):
            # Each choice's first chunk carries the prompt's length, and only it.
            assert c.HasField("prompt_tokens") == (c.index not in ids), c
            ids.setdefault(c.index, []).extend(c.token_ids)
            if c.finish_reason:
                finished.append(c.index)
                assert c.usage.completion_tokens == 5, c.usage
        assert sorted(finished) == [0, 1, 2], finished
        for i in range(3):
            alone = [t for c in stub.Generate(request(9 + i), timeout=60) for t in c.token_ids]
            assert ids[i] == alone, (i, ids[i], alone)
        # Special tokens' text only when asked (a bias forces <|im_start|>).
        start = stub.Tokenize(generation_pb2.TokenizeRequest(text="<|im_start|>")).ids
        assert len(start) == 1, start
        biased = common_pb2.SamplingParams(temperature=0.0, logit_bias={start[0]: 100.0})
        for skip, want in [(None, ""), (False, "<|im_start|>" * 2)]:
            req = generation_pb2.GenerateRequest(
                text="x", sampling=biased, max_tokens=2, skip_special_tokens=skip
            )
            text = "".join(c.text for c in stub.Generate(req, timeout=60))
            assert text == want, (skip, text)
        # Reasoning and tool calls read out of the answer when asked (a regex forces one).
        answer = (
            r'<think>\nhm\.\n</think>\n\nOk\.\n<tool_call>\n'
            r'\{"name": "w", "arguments": \{"c": "P"\}\}\n</tool_call>'
        )
        forced = common_pb2.SamplingParams(
            temperature=0.0, structured_output=common_pb2.StructuredOutput(regex=answer)
        )
        req = generation_pb2.GenerateRequest(
            text="x", sampling=forced, max_tokens=80, parse_reasoning=True, parse_tool_calls=True
        )
        reasoning, text, names, arguments = "", "", [], ""
        for c in stub.Generate(req, timeout=60):
            reasoning += c.reasoning
            text += c.text
            for part in c.tool_calls:
                if part.HasField("name"):
                    names.append(part.name)
                arguments += part.arguments
        assert (reasoning, text, names) == ("hm.", "Ok.", ["w"]), (reasoning, text, names)
        assert arguments == '{"c": "P"}', arguments

    def abort():
        req = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=list(range(1, 40))),
            sampling=greedy,
            max_tokens=3000,
            ignore_eos=True,
            request_id="py-abort",
        )
        stream = stub.Generate(req, timeout=60)
        next(stream)
        assert stub.Abort(generation_pb2.AbortRequest(request_id="py-abort")).aborted
        last = None
        for c in stream:
            last = c
        assert last is None or last.finish_reason in (
            common_pb2.FINISH_REASON_ABORT,
            common_pb2.FINISH_REASON_UNSPECIFIED,
        ), last
        assert not stub.Abort(generation_pb2.AbortRequest(request_id="py-abort")).aborted

    def bad_input_codes():
        cases = {
            "empty prompt": generation_pb2.GenerateRequest(text="", max_tokens=4),
            "temperature": generation_pb2.GenerateRequest(
                text="x", max_tokens=4, sampling=common_pb2.SamplingParams(temperature=-1.0)
            ),
            "top_p": generation_pb2.GenerateRequest(
                text="x", max_tokens=4, sampling=common_pb2.SamplingParams(top_p=0.0)
            ),
            "token id": generation_pb2.GenerateRequest(
                token_ids=generation_pb2.TokenIds(ids=[10**9]), max_tokens=4
            ),
            "max_tokens": generation_pb2.GenerateRequest(text="x", max_tokens=0),
            "presence_penalty": generation_pb2.GenerateRequest(
                text="x", max_tokens=4, sampling=common_pb2.SamplingParams(presence_penalty=2.5)
            ),
            "bad_words": generation_pb2.GenerateRequest(
                text="x", max_tokens=4, bad_words=["w"] * 129
            ),
            "logit_bias": generation_pb2.GenerateRequest(
                text="x", max_tokens=4, sampling=common_pb2.SamplingParams(logit_bias={1: 101.0})
            ),
            "min_tokens": generation_pb2.GenerateRequest(
                text="x", max_tokens=4, sampling=common_pb2.SamplingParams(min_tokens=5)
            ),
        }
        for name, req in cases.items():
            try:
                list(stub.Generate(req, timeout=30))
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e.code(), e.details())
                assert e.details(), name
            else:
                raise AssertionError(f"{name} was accepted")

    def tokenize_and_models():
        ids = stub.Tokenize(generation_pb2.TokenizeRequest(text="Hello world")).ids
        assert list(ids) == [9707, 1879], ids
        models = stub.ListModels(generation_pb2.ListModelsRequest()).models
        assert len(models) == 1 and models[0].name, models

    def health():
        h = health_pb2_grpc.HealthStub(channel)
        r = h.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.SERVING, r

    def reflection():
        r = reflection_pb2_grpc.ServerReflectionStub(channel)
        reqs = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        names = [s.name for resp in r.ServerReflectionInfo(reqs, timeout=10) for s in resp.list_services_response.service]
        assert "pd.v1.Generation" in names, names
        assert "grpc.health.v1.Health" in names, names

    checks = [stream_text, choices, abort, bad_input_codes, tokenize_and_models, health, reflection]
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
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
