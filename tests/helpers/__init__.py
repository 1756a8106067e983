"""What tests share that is not a fixture: fakes, stand-ins and small readers. A test module
imports from here, never from another test module or a conftest."""
