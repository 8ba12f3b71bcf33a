"""What the fuzzing suite is made of: strategies, properties, the corpus. Shared by ``tests/proxy/test_app_fuzz.py``
(CI, small budget) and ``bench/fuzz.py`` (large budget), so both run exactly the same properties.

Why in ``testkit``: the bench must not import the test suite, and neither edits ``sys.path``; ``python -m
bench.fuzz`` from the repository root imports ``testkit.fuzzing`` like any package.

Modules, by what they fuzz:

- ``json_writer``: bodies written the way real clients and the rarest ones write JSON, media sites recorded.
- ``media_values``: real tiny media files and every way to send or mangle them.
- ``documents``: bodies per dialect (chat, responses, Anthropic messages, ``/generate``), the HTTP cases.
- ``http_media``: the properties on what crosses the wire (any body; with resize on).
- ``paths``: request targets against ``MMGATE_ALLOW_PATHS``.
- ``pure``: rawjson, ``parse_data_url`` and ``decode_base64`` against references.
- ``faults``: failure signatures, the proxy's logged faults, the running harness.
- ``properties``: the registry of every property; ``corpus``: the seed, the kept failing inputs, their replay.
- ``search``: the bench's large-budget search, rounds of fresh seeds that count known failures and go on.
"""
