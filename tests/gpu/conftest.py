"""GPU tests: marked ``gpu`` and skipped where CUDA is not available."""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA (run on the GPU host)")
