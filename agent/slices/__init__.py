"""ResourceSlices: pure building from the inventory (`build`) and the publisher that keeps the API in step."""
