"""vitviz for agents: the running app serves its public endpoints as MCP tools (`VITVIZ_MCP=1`),
each typed and documented; an agent lists them and analyses an image."""

import asyncio
import base64
import io

import pytest
from PIL import Image

import vitviz

pytestmark = pytest.mark.slow


def _data_url() -> str:
    buf = io.BytesIO()
    Image.fromarray(vitviz.shapes.render(3, seed=5, index=0)[0]).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_an_agent_lists_the_tools_and_analyses_an_image():
    pytest.importorskip("mcp")
    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    import app

    app.demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, **{**app.LAUNCH_KWARGS, "mcp_server": True})
    url = app.demo.local_url.rstrip("/") + "/gradio_api/mcp/http/"

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
        asyncio.run(talk())
    finally:
        app.demo.close()
