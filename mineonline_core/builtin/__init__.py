"""The components the core ships as an ordinary plugin (``defaults``): the built-in policies
(``models``), the gymnasium/Crafter env factory, the memory store and the console logger."""
