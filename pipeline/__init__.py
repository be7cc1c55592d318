"""The pipeline as a whole, above the services: what composes them without a broker.

``pipeline.replay`` drives the attributor's engine, billing's pricing and the guard's engine over one input in
the order the stream delivers it; ``pipeline.recordings`` reads and writes that input (scenarios through the
simulator and the collector's sampling code, ``*.gmrec`` recordings); ``pipeline.truth`` is the simulator's
ground truth on the same windows; ``pipeline.cli`` is ``gpumeter replay``. The services never import this
package; it imports theirs (``tests/unit/core/test_layout.py`` checks both directions).
"""
