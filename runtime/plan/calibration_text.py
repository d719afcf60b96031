"""Built-in calibration text for `ft plan --calibrate N`: a few short passages of different kinds (prose, code, a
conversation, data, arithmetic, instructions), so that the routing counted over them is not one genre's."""

PASSAGES = (
    """The harbour was quiet before dawn. Fishing boats rocked against the pier, their ropes creaking, while gulls
circled the lamp posts looking for scraps left from the evening market. An old man sat on an upturned crate and mended
a net with quick, practised knots. He had done this every morning for forty years, and he still counted the holes
aloud, as his father had taught him, so that none would be missed when the tide turned.""",
    '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals and return them sorted."""
    result = []
    for start, end in sorted(intervals):
        if result and start <= result[-1][1]:
            result[-1][1] = max(result[-1][1], end)
        else:
            result.append([start, end])
    return result


class LRUCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        value = self.items.pop(key, None)
        if value is not None:
            self.items[key] = value
        return value
''',
    """User: My build fails with "undefined reference to pthread_create". What am I missing?
Assistant: The linker cannot find the POSIX threads library. Add -pthread to both the compile and the link flags, for
example CFLAGS += -pthread and LDFLAGS += -pthread in your Makefile, then rebuild from a clean tree.
User: That fixed it, thanks. Why does the order of libraries matter on the command line?
Assistant: A static linker resolves symbols from left to right, so a library must come after the objects that use
it.""",
    """{"order_id": 48213, "customer": {"name": "Ada Moreno", "city": "Valencia"}, "items": [{"sku": "TB-220",
"qty": 2, "price": 18.5}, {"sku": "LM-014", "qty": 1, "price": 42.0}], "paid": true, "shipped_at": null}
id,date,temperature_c,rain_mm
1,2024-03-01,11.4,0.0
2,2024-03-02,9.8,3.2
3,2024-03-03,12.1,0.4""",
    """To solve 3x + 7 = 25, subtract 7 from both sides to get 3x = 18, then divide by 3: x = 6. The area of a circle
of radius r is pi r^2, so a radius of 4 cm gives about 50.27 square centimetres. If a train leaves at 14:10 and the
journey takes 2 hours 55 minutes, it arrives at 17:05. The sum of the first n odd numbers is n^2.""",
    """Installation steps:
1. Download the archive and check its SHA-256 against the published value.
2. Extract it into /opt/tool and add /opt/tool/bin to your PATH.
3. Run `tool init` once; it writes a configuration file to ~/.config/tool/config.toml.
4. Edit the file to set your default region, then run `tool status` to confirm that everything works.
If a step fails, run the command again with --verbose and include the output when you report the problem.""",
    """La bibliothèque municipale ouvre ses portes à neuf heures. Los estudiantes llegan temprano para encontrar una
mesa junto a la ventana. Die Bibliothekarin sortiert die neuen Bücher und stellt sie ins Regal. 图书馆里很安静，
只有翻书的声音。""",
    """Review notes: the patch moves the retry loop out of the request handler, which is good, but the backoff now
starts at zero, so the first retry hammers the server immediately. Please start at 100 ms and cap the delay at five
seconds. Also, the new test only covers the success path; add one where every attempt fails and check that the error
returned to the caller names the last status code.""",
)
