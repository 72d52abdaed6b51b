"""Third-party clients against a router with API keys (`--api-keys`): Python grpcio (stubs
generated from proto/) and the official `openai` package are refused without the key or with a
wrong one (UNAUTHENTICATED / 401 with OpenAI's `invalid_api_key` error) and served with it.
With CA (a `pdctl up --secure` cluster) every client speaks TLS trusting that CA, and plaintext
clients of the same ports are refused.

Usage: python3 tests/python/auth_client_test.py ROUTER_ADDR OPENAI_BASE_URL KEY [CA]
Prints one line per check and a closing summary line; exits non-zero on failure.
"""

import ssl
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
    ca = sys.argv[4] if len(sys.argv) > 4 else None
    generate_stubs(tempfile.mkdtemp())
    from pd.v1 import common_pb2, generation_pb2, generation_pb2_grpc  # noqa: E402

    if ca:
        assert base_url.startswith("https://"), base_url
        with open(ca, "rb") as f:
            credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
        channel = grpc.secure_channel(router, credentials)
        http_client = lambda: openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=ca))  # noqa: E731
        url_context = ssl.create_default_context(cafile=ca)
    else:
        channel = grpc.insecure_channel(router)
        http_client = lambda: None  # noqa: E731
        url_context = None
    stub = generation_pb2_grpc.GenerationStub(channel)
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
        client = openai.OpenAI(
            base_url=base_url, api_key="wrong-key", max_retries=0, http_client=http_client()
        )
        try:
            client.completions.create(model="synthetic:tiny", prompt="Hi", max_tokens=2)
        except openai.AuthenticationError as e:
            assert e.status_code == 401, e.status_code
            assert e.code == "invalid_api_key", e.body
            return
        raise AssertionError("served with a wrong key")

    def openai_with_key():
        client = openai.OpenAI(
            base_url=base_url, api_key=key, max_retries=0, timeout=60, http_client=http_client()
        )
        r = client.completions.create(model="synthetic:tiny", prompt="Hi", max_tokens=2)
        assert r.usage.completion_tokens == 2, r.usage
        assert len(client.models.list().data) == 1

    def health_needs_no_key():
        url = base_url.rstrip("/").removesuffix("/v1") + "/health"
        with urllib.request.urlopen(url, timeout=10, context=url_context) as response:
            assert response.status == 200, response.status

    def plaintext_grpc_refused():
        plain = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(router))
        try:
            plain.ListModels(
                generation_pb2.ListModelsRequest(),
                metadata=[("authorization", f"Bearer {key}")],
                timeout=10,
            )
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e.code()
            return
        raise AssertionError("a TLS port served a plaintext gRPC client")

    def plaintext_http_refused():
        plain_url = base_url.replace("https://", "http://", 1)
        client = openai.OpenAI(base_url=plain_url, api_key=key, max_retries=0, timeout=10)
        try:
            client.models.list()
        except openai.APIConnectionError:
            return
        raise AssertionError("a TLS port served a plaintext HTTP client")

    def openai_without_ca_refused():
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=10)
        try:
            client.models.list()
        except openai.APIConnectionError:
            return
        raise AssertionError("a client that does not trust the cluster CA connected")

    checks = [
        grpc_without_key,
        grpc_wrong_key,
        grpc_with_key,
        openai_wrong_key,
        openai_with_key,
        health_needs_no_key,
    ]
    if ca:
        checks += [plaintext_grpc_refused, plaintext_http_refused, openai_without_ca_refused]
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
