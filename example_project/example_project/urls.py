from demo import views
from django.contrib import admin
from django.urls import path

urlpatterns = [
    path("", views.index, name="index"),
    path("report/", views.slow_report, name="slow-report"),
    path("async-report/", views.async_report, name="async-report"),
    path("export/", views.export, name="export"),
    path("task/", views.task, name="task"),
    path("locks/", views.lock_list, name="lock-list"),
    path("admin/", admin.site.urls),
]
