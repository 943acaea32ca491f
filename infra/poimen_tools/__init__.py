"""Workstation and CI tooling around the Lambda bundle: the `poimen` CLI, `poimen dev`, template reading.

Never shipped in the layer: it needs moto, boto3 and PyYAML, which Lambda does not.
"""
