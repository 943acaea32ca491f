"""Prints the OpenAPI document of the admission API; `make openapi` keeps infra/openapi.json current."""

from __future__ import annotations

import json

from poimen.api import openapi_document

if __name__ == "__main__":
    print(json.dumps(openapi_document(), indent=2, sort_keys=True))
