"""The NVIDIA driver's user-space files a container needs, found once at start-up under the driver root.

`ldcache` and `elf` read the two binary formats involved (pure: bytes in), `files` is the model of what was
found, `discovery` the thin I/O module that walks a driver root, and `edits` turns the files into the CDI
container edits every claim's spec shares (pure).
"""
