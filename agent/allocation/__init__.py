"""The local allocator (pure): which devices of one node fit a request, and how well; placement policies."""
