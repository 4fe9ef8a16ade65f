"""``fastweights lab``: the seeds' interactive demos on a local web page.

Four panels, each with the passage of the seed it illustrates and a button that
resets it to the seed's own example:

1. interference: N pairs in a d×d state (seed 002 §4.3), recall and error against N;
2. 2-D geometry: the sum rule's pile-up vs the delta rule's erase-and-write, and the
   Householder factor I − βkkᵀ (seed 001 ch. 2-6);
3. spotlight vs floodlight: softmax with a sharpness slider vs linear attention with
   each feature map (seed 002 §4.3);
4. memory calculator: KV cache vs fixed state per session (seed 002 §4.2), the same
   numbers as ``fastweights study costs``.

Every number is computed in Python by :mod:`fastweights.ops` and the studies
(:mod:`fastweights.lab.compute`); the page (``static/``) only draws. The server
(:mod:`fastweights.lab.server`) is the standard library's ``http.server``: no
dependency, no network, no third-party asset.
"""
