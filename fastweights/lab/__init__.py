"""``fastweights lab``: interactive demos on a local web page.

Four panels, each with the passage of the seed it illustrates and a button that
resets it to the worked example:

1. interference: N pairs in a d×d state (docs/worked_examples.md), recall and error against N;
2. 2-D geometry: the sum rule's pile-up vs the delta rule's erase-and-write, and the
   Householder factor I − βkkᵀ (Schlag et al. 2021);
3. spotlight vs floodlight: softmax with a sharpness slider vs linear attention with
   each feature map (docs/worked_examples.md);
4. memory calculator: KV cache vs fixed state per session (docs/worked_examples.md), the same
   numbers as ``fastweights study costs``.

Every number is computed in Python by :mod:`fastweights.ops` and the studies
(:mod:`fastweights.lab.compute`); the page (``static/``) only draws. The server
(:mod:`fastweights.lab.server`) is the standard library's ``http.server``: no
dependency, no network, no third-party asset.
"""
