"""api_server.DirectRoutes: the generation endpoints' POSTs bypass FastAPI's stack, and still answer errors as
its exception handlers do; every other request reaches the app unchanged."""

import asyncio

import httpx
import pytest

pytest.importorskip("fastapi")

from starlette.responses import JSONResponse, Response  # noqa: E402

from ostinato.entrypoints.openai.api_server import DirectRoutes  # noqa: E402
from ostinato.entrypoints.openai.errors import OpenAIError  # noqa: E402


async def inner(scope, receive, send) -> None:
    await Response(f"app {scope['method']} {scope['path']}", status_code=203)(scope, receive, send)


async def ok(request) -> Response:
    return JSONResponse({"echo": (await request.json())["x"]})


async def refused(request) -> Response:
    raise OpenAIError(400, "temperature must be >= 0, got -1", param="temperature", code="invalid_value")


async def broken(request) -> Response:
    raise RuntimeError("boom")


def test_direct_routes_answer_and_pass_the_rest_on(caplog):
    app = DirectRoutes(inner, {"/v1/ok": ok, "/v1/refused": refused, "/v1/broken": broken})

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
            return [await http.post("/v1/ok", json={"x": 7}), await http.post("/v1/refused", json={}),
                    await http.post("/v1/broken", json={}), await http.get("/v1/ok"),
                    await http.post("/v1/other", json={})]

    good, bad, err, get, other = asyncio.run(main())
    assert (good.status_code, good.json()) == (200, {"echo": 7})
    assert bad.status_code == 400 and bad.json()["error"] == {
        "message": "temperature must be >= 0, got -1", "type": "invalid_request_error", "param": "temperature",
        "code": "invalid_value"}
    assert err.status_code == 500 and err.json()["error"]["code"] == "internal_error"
    assert "RuntimeError: boom" in err.json()["error"]["message"] and "internal error" in caplog.text
    assert (get.status_code, get.text) == (203, "app GET /v1/ok")  # not a POST: the app's routing answers
    assert (other.status_code, other.text) == (203, "app POST /v1/other")
