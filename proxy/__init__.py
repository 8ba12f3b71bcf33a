"""mmgate: the proxy server (aiohttp)."""
