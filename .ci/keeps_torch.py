"""Fail if a `pip install --dry-run --report FILE` would install torch or torchvision, i.e. replace
the environment's torch (its version is within the project's range)."""

import json
import sys

names = [i["metadata"]["name"].lower() for i in json.load(open(sys.argv[1]))["install"]]
print("pip would install:", ", ".join(names) or "nothing")
sys.exit("pip would replace the environment's torch" if {"torch", "torchvision"} & set(names) else 0)
