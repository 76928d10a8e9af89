"""A --preload module that leaves a Python thread running: the zygote must refuse to fork."""
import threading
import time

threading.Thread(target=time.sleep, args=(3600,), daemon=True, name="leftover").start()
