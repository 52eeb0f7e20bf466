cpdef int refuse_in_capture(str what) except -1
cpdef object check_timeout(object timeout)
cpdef str loop_here()
cpdef int refuse_on_loop(str what) except -1
