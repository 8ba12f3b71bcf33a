"""Media work for mmgate: data URLs and base64, images, audio. Plain thread-safe Python, no aiohttp."""
