"""A user's Hugging Face config.json, read: shared by the command line (which parses before torch is
imported) and remat.memory, so that the library never imports the CLI."""

import json


def config_fields(path):
    """The fields of a user's config.json; a ValueError naming the model if it is none."""
    try:
        with open(path) as handle:
            fields = json.load(handle)
    except (OSError, ValueError) as error:  # unreadable, or not JSON (json's error is a ValueError)
        raise ValueError(f"model {path!r} is not a readable config.json: {error}") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ValueError(f"model {path!r} has no \"model_type\": it must be a Hugging Face config.json")
    return fields
