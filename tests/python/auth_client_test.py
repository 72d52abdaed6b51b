"""Third-party clients against a router with API keys (`--api-keys`): Python grpcio (stubs
generated from proto/) and the official `openai` package are refused without the key or with a
wrong one (UNAUTHENTICATED / 401 with OpenAI's `invalid_api_key` error) and served with it.

Usage: python3 tests/python/auth_client_test.py ROUTER_ADDR OPENAI_BASE_URL KEY
Prints one line per check and a closing summary line; exits non-zero on failure.
"""

import sys
import tempfile
import traceback
import urllib.error
import urllib.request

import grpc
import openai

from client_test import generate_stubs


def main():
    router, base_url, key = sys.argv[1], sys.argv[2], sys.argv[3]
    generate_stubs(tempfile.mkdtemp())
    from pd.v1 import common_pb2, generation_pb2, generation_pb2_grpc  # noqa: E402

    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(router))
    request = generation_pb2.GenerateRequest(
        text="Hello", sampling=common_pb2.SamplingParams(temperature=0.0), max_tokens=3
    )

    def grpc_refused(metadata):
        try:
            list(stub.Generate(request, metadata=metadata, timeout=60))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e.code()
            assert "wrong-key" not in e.details(), e.details()
            return
        raise AssertionError("served without a valid key")

    def grpc_without_key():
        grpc_refused(None)

    def grpc_wrong_key():
        grpc_refused([("authorization", "Bearer wrong-key")])

    def grpc_with_key():
        chunks = list(
            stub.Generate(request, metadata=[("authorization", f"Bearer {key}")], timeout=60)
        )
        assert chunks[-1].usage.completion_tokens == 3, chunks[-1]

    def openai_wrong_key():
        client = openai.OpenAI(base_url=base_url, api_key="wrong-key", max_retries=0)
        try:
            client.completions.create(model="synthetic:tiny", prompt="Hi", max_tokens=2)
        except openai.AuthenticationError as e:
            assert e.status_code == 401, e.status_code
            assert e.code == "invalid_api_key", e.body
            return
        raise AssertionError("served with a wrong key")

    def openai_with_key():
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)
        r = client.completions.create(model="synthetic:tiny", prompt="Hi", max_tokens=2)
        assert r.usage.completion_tokens == 2, r.usage
        assert len(client.models.list().data) == 1

    def health_needs_no_key():
        url = base_url.rstrip("/").removesuffix("/v1") + "/health"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200, response.status

    checks = [
        grpc_without_key,
        grpc_wrong_key,
        grpc_with_key,
        openai_wrong_key,
        openai_with_key,
        health_needs_no_key,
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
    print(f"auth clients: {passed} checks passed, {failed} failed against {router}, {base_url}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
