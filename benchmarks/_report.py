"""What the small benchmark scripts share: print a result as one JSON line, and keep it in a file."""

import json
from typing import Optional


def emit(result: dict, out: Optional[str]) -> None:
    print(json.dumps(result))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
