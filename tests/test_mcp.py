"""vitviz for agents: the running app serves its public endpoints as MCP tools (`VITVIZ_MCP=1`),
each typed and documented; an agent lists them and analyses an image."""

import asyncio
import base64
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port, wait_for
from PIL import Image

import vitviz

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _data_url() -> str:
    buf = io.BytesIO()
    Image.fromarray(vitviz.shapes.render(3, seed=5, index=0)[0]).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_an_agent_lists_the_tools_and_analyses_an_image(tmp_path):
    """`VITVIZ_MCP=1 python app.py`, as the README says, in a process of its own (Gradio's MCP
    server can start once per app and process)."""
    pytest.importorskip("mcp")
    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    port = free_port()
    env = dict(os.environ, VITVIZ_MCP="1", GRADIO_SERVER_PORT=str(port), GRADIO_ANALYTICS_ENABLED="False", TMPDIR=str(tmp_path),
               GRADIO_TEMP_DIR=str(tmp_path / "gradio"))
    server = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    url = f"{base}/gradio_api/mcp/http/"

    async def talk():
        async with streamablehttp_client(url) as (read, write, _), ClientSession(read, write) as session:
            await session.initialize()
            tools = {t.name: t for t in (await session.list_tools()).tools}
            analyze = next(t for name, t in tools.items() if name.endswith("api_analyze"))
            explain = next(t for name, t in tools.items() if name.endswith("api_explain"))
            attention = next(t for name, t in tools.items() if name.endswith("api_attention"))
            # typed and documented: the schema names every argument, the description says what it does
            assert {"image", "variant"} <= set(analyze.inputSchema["properties"]) and "rollout" in analyze.description
            assert {"target", "method"} <= set(explain.inputSchema["properties"]) and "Chefer" in str(explain.inputSchema)
            assert {"layer", "head", "query"} <= set(attention.inputSchema["properties"])
            image = _data_url()
            result = await session.call_tool(analyze.name, {"image": image, "variant": "shapes_p16"})
            assert not result.isError, result
            text = " ".join(c.text for c in result.content if getattr(c, "text", None))
            assert "star" in text
            result = await session.call_tool(explain.name, {"image": image, "variant": "shapes_p16", "target": "star", "method": "gradient"})
            assert not result.isError and any(c.type == "image" for c in result.content), result
            assert any("explain-gradient-star" in getattr(c, "text", "") for c in result.content), result
            result = await session.call_tool(attention.name, {"image": image, "variant": "shapes_p16", "layer": 6, "head": "mean", "query": 0})
            assert not result.isError and any(c.type == "image" for c in result.content), result
            result = await session.call_tool(analyze.name, {"image": image, "variant": "shapes_p16@4096"})
            text = " ".join(c.text for c in result.content if getattr(c, "text", None))
            assert result.isError and "VITVIZ_MAX_TOKENS" in text

    try:
        wait_for(base + "/", server)
        asyncio.run(talk())
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
