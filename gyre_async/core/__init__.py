"""The pure cores of the roles (sampler, segmenter, learner, keeper, evaluation): no bus, no asyncio."""
