"""Media URLs fetched by mmgate itself: SSRF-safe resolution and bounded downloads."""
