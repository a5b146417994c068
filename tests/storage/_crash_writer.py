"""Child of the crash test: writes pages and prints ``index hex`` after each put returns."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tests.storage.conftest import open_disk, page


async def main(root: Path, count: int, batch: int) -> None:
    tier = open_disk(root)
    print("ready", flush=True)
    for start in range(0, count, batch):
        items = [page(i, size=4096) for i in range(start, min(count, start + batch))]
        await tier.put_many(items)
        for i, (k, _) in zip(range(start, start + batch), items, strict=False):
            sys.stdout.write(f"{i} {k.hex()}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
