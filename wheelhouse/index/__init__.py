"""The index's files and who may change them: storage, the layout of keys, the catalog, publishing
and its claims, owners, uploads and their checks, variant wheels, the upstream and its pull-
through mirror, tokens, manage, gc and verify.
"""
